//! A JSON page read with the bot's JSONPath rules: links from `follow`'s `$` entries (string
//! values, or arrays of them), listing items from `list.item` (each read relative to the item),
//! a record from `record.natural_key` and `record.fields`, whose values keep their JSON types
//! (numbers, booleans, arrays, objects) in the stored record.

use bson::{Bson, Document};
use serde_json::Value;
use url::Url;

use super::{collapse_whitespace, parse_time, JsonRule, LinkRules, ListItem, ListRules, PageData};
use super::{RecordRules, Resolver};

/// Objects nested deeper than this are stored as their JSON text (BSON allows 100 levels).
const MAX_DEPTH: usize = 64;

/// Reads a JSON page; see [`super::extract`].
pub(super) fn extract(
    page_url: &Url,
    body: &str,
    links: &LinkRules,
    list: Option<&ListRules>,
    record: Option<&RecordRules>,
) -> PageData {
    let mut data = PageData::default();
    let value: Value = match serde_json::from_str(body) {
        Ok(v) => v,
        Err(e) => {
            data.record = Some(Err(format!("not valid JSON ({e})")));
            return data;
        }
    };
    let resolver = Resolver::new(page_url, links);
    let mut matched = read_links(&value, &resolver, &mut data);
    if let Some(rules) = list {
        matched |= read_items(&value, rules, &resolver, &mut data);
    }
    if let Some(rules) = record.filter(|r| r.url_match.is_match(page_url.as_str())) {
        data.record = Some(read_record(&value, rules));
        matched = true;
    }
    if !matched {
        data.record = Some(Err(unmatched(links, list)));
    }
    data.bounded = resolver.bounded();
    data
}

/// Why a JSON page yields nothing: the JSONPath rules it was read with (none matched).
fn unmatched(links: &LinkRules, list: Option<&ListRules>) -> String {
    let mut rules: Vec<String> = links
        .follow_json
        .iter()
        .map(|r| format!("follow {}", r.as_str()))
        .collect();
    if let Some(item) = list.and_then(|l| l.item.json.as_ref()) {
        rules.push(format!("list.item {}", item.as_str()));
    }
    if rules.is_empty() {
        "a JSON page, and the bot has no JSONPath rule (`$…`) for one".into()
    } else {
        format!(
            "a JSON page that no JSONPath rule of the bot matches ({})",
            rules.join(", ")
        )
    }
}

/// The first value `rule` selects in `scope`.
fn first<'v>(rule: &JsonRule, scope: &'v Value) -> Option<&'v Value> {
    rule.path.query(scope).first()
}

/// A value as text: a string trimmed (inner white space collapsed), a number or boolean as JSON
/// writes it, an array or object as compact JSON; `None` for null or an empty string.
pub(super) fn text(value: &Value) -> Option<String> {
    let text = match value {
        Value::Null => return None,
        Value::String(s) => collapse_whitespace(s),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => other.to_string(),
    };
    (!text.is_empty()).then_some(text)
}

/// The followable links `follow`'s JSONPath entries select, in order, deduplicated, at most
/// `max`; whether any entry selected a value at all.
fn read_links(value: &Value, resolver: &Resolver<'_>, data: &mut PageData) -> bool {
    let mut matched = false;
    let mut seen = std::collections::HashSet::new();
    for rule in &resolver.rules.follow_json {
        for node in rule.path.query(value).all() {
            matched = true;
            let hrefs: Vec<&str> = match node {
                Value::String(s) => vec![s.as_str()],
                Value::Array(values) => values.iter().filter_map(Value::as_str).collect(),
                _ => Vec::new(),
            };
            for href in hrefs {
                if data.links.len() >= resolver.rules.max {
                    data.dropped += 1;
                    continue;
                }
                if let Some(url) = resolver.follow(href.trim()) {
                    if seen.insert(url.clone()) {
                        data.links.push(url);
                    }
                }
            }
        }
    }
    matched
}

/// The listing items `list.item`'s JSONPath selects, at most `max`; whether it selected any.
/// An item without an id is skipped, as on an HTML page.
fn read_items(
    value: &Value,
    rules: &ListRules,
    resolver: &Resolver<'_>,
    data: &mut PageData,
) -> bool {
    let (Some(item_rule), Some(id_rule)) = (&rules.item.json, &rules.item_id.json) else {
        return false;
    };
    let nodes = item_rule.path.query(value).all();
    let matched = !nodes.is_empty();
    for item in nodes {
        if data.items.len() >= resolver.rules.max {
            data.dropped += 1;
            continue;
        }
        let Some(id) = first(id_rule, item).and_then(text) else {
            continue;
        };
        let url = rules
            .item_link
            .json
            .as_ref()
            .and_then(|rule| first(rule, item))
            .and_then(Value::as_str)
            .and_then(|href| resolver.follow(href.trim()));
        let fingerprint = rules
            .fingerprint_json
            .iter()
            .map(|rule| first(rule, item).and_then(text).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\u{1f}");
        let updated_at = rules
            .updated_at
            .json
            .as_ref()
            .and_then(|rule| first(rule, item))
            .and_then(time);
        data.items.push(ListItem {
            id,
            url,
            fingerprint,
            updated_at,
            unversioned: false,
        });
    }
    matched
}

/// A change time: a string as [`parse_time`] reads it, or a number of Unix seconds.
fn time(value: &Value) -> Option<chrono::DateTime<chrono::Utc>> {
    match value {
        Value::String(s) => parse_time(s),
        Value::Number(n) => {
            let seconds = n.as_f64()?;
            let millis = (seconds * 1000.0).round();
            if !millis.is_finite() || millis.abs() > 8.64e15 {
                return None;
            }
            chrono::DateTime::from_timestamp_millis(millis as i64)
        }
        _ => None,
    }
}

/// A JSON detail page's natural key and fields (each the first value its path selects, null
/// when none), or why there is no record.
fn read_record(value: &Value, rules: &RecordRules) -> Result<(String, Document), String> {
    let Some(natural_key) = &rules.natural_key.json else {
        return Err(
            "no natural key: record.natural_key has no JSONPath (`$…`) for a JSON page".into(),
        );
    };
    let Some(key) = first(natural_key, value).and_then(text) else {
        return Err(format!(
            "no natural key ({}) on the page",
            natural_key.as_str()
        ));
    };
    let mut fields = Document::new();
    for (name, field) in &rules.fields {
        let values: Vec<Value> = match &field.pick.json {
            Some(rule) if field.all => rule.path.query(value).all().into_iter().cloned().collect(),
            Some(rule) => first(rule, value).cloned().into_iter().collect(),
            None => Vec::new(),
        };
        let stored = field
            .store(values, false)
            .map_err(|e| format!("record.fields.{name}: {e}"))?;
        fields.insert(name.clone(), stored);
    }
    Ok((key, fields))
}

/// A JSON value as BSON, types kept: an integer that fits is an Int64, any other number a
/// Double. An object whose keys MongoDB would read as operators or paths (a leading `$`, a
/// `.`), or nested past [`MAX_DEPTH`], is stored as its JSON text.
pub(super) fn to_bson(value: &Value, depth: usize) -> Bson {
    match value {
        Value::Null => Bson::Null,
        Value::Bool(b) => Bson::Boolean(*b),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => Bson::Int64(i),
            (None, Some(f)) => Bson::Double(f),
            _ => Bson::String(n.to_string()),
        },
        Value::String(s) => Bson::String(s.clone()),
        _ if depth >= MAX_DEPTH => Bson::String(value.to_string()),
        Value::Array(values) => Bson::Array(values.iter().map(|v| to_bson(v, depth + 1)).collect()),
        Value::Object(map) => {
            let storable = map
                .keys()
                .all(|k| !k.starts_with('$') && !k.contains('.') && !k.contains('\0'));
            if !storable {
                return Bson::String(value.to_string());
            }
            let mut doc = Document::new();
            for (k, v) in map {
                doc.insert(k.clone(), to_bson(v, depth + 1));
            }
            Bson::Document(doc)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{extract, selector, BodyFormat, Field, HtmlRead, Pick};
    use super::*;
    use crate::urls::StripQuery;

    fn rule(raw: &str) -> JsonRule {
        JsonRule::parse(raw).unwrap()
    }

    fn json(raw: &str) -> Pick<HtmlRead> {
        Pick {
            html: None,
            json: Some(rule(raw)),
        }
    }

    fn field(raw: &str) -> Field {
        Field {
            pick: json(raw),
            ty: None,
            all: false,
            required: false,
        }
    }

    fn links() -> LinkRules {
        LinkRules {
            scope: vec!["shop.test".into()],
            follow: Some(selector("a[href]").unwrap()),
            follow_json: vec![rule("$.next"), rule("$.related")],
            allow: vec![],
            deny: vec![],
            strip: StripQuery::parse(&[]).unwrap(),
            max: 10_000,
            max_url_length: 2048,
        }
    }

    fn list() -> ListRules {
        ListRules {
            item: Pick {
                html: Some(selector(".item").unwrap()),
                json: Some(rule("$.products[*]")),
            },
            item_id: json("$.id"),
            item_link: json("$.url"),
            fingerprint: vec![],
            fingerprint_json: vec![rule("$.price"), rule("$.stock")],
            updated_at: json("$.updated"),
        }
    }

    fn record() -> RecordRules {
        RecordRules {
            url_match: regex::Regex::new("/api/product/").unwrap(),
            natural_key: json("$.sku"),
            fields: [
                ("price", "$.price.amount"),
                ("tags", "$.tags"),
                ("stock", "$.stock"),
                ("missing", "$.nope"),
                ("odd", "$.odd"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), field(v)))
            .collect(),
        }
    }

    fn read(url: &str, body: &str) -> PageData {
        let url = Url::parse(url).unwrap();
        extract(
            &url,
            body,
            BodyFormat::Json,
            &links(),
            Some(&list()),
            Some(&record()),
        )
    }

    #[test]
    fn a_json_listing_yields_items_relative_to_each_and_its_next_link() {
        let body = r#"{"products": [
            {"id": 7, "url": "/api/product/7", "price": 12.5, "stock": true, "updated": "2026-01-02T03:04:05Z"},
            {"id": "B", "url": "https://shop.test/api/product/B?x=1", "price": {"amount": 3}, "updated": 1767323045},
            {"url": "/api/product/no-id"},
            {"id": "C", "url": "https://elsewhere.test/c"}
          ],
          "next": "/api/products?page=2",
          "related": ["/a", "https://elsewhere.test/b", 3, "/a"]}"#;
        let data = read("https://shop.test/api/products?page=1", body);
        assert!(data.record.is_none(), "a listing page has no record");
        let ids: Vec<&str> = data.items.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(ids, ["7", "B", "C"], "an item without an id is skipped");
        assert_eq!(
            data.items[0].url.as_ref().unwrap().as_str(),
            "https://shop.test/api/product/7"
        );
        assert_eq!(data.items[0].fingerprint, "12.5\u{1f}true");
        assert_eq!(
            data.items[1].fingerprint, "{\"amount\":3}\u{1f}",
            "an object is its JSON text; a missing value is empty"
        );
        assert_eq!(
            data.items[0].updated_at.unwrap().to_rfc3339(),
            "2026-01-02T03:04:05+00:00"
        );
        assert_eq!(
            data.items[1].updated_at.unwrap().timestamp(),
            1_767_323_045,
            "a number is Unix seconds"
        );
        assert!(
            data.items[2].url.is_none(),
            "an out-of-scope link is not kept"
        );
        let found: Vec<&str> = data.links.iter().map(|u| u.as_str()).collect();
        assert_eq!(
            found,
            [
                "https://shop.test/api/products?page=2",
                "https://shop.test/a"
            ],
            "strings and arrays of strings, resolved, in scope, once each"
        );
    }

    #[test]
    fn a_json_detail_page_keeps_its_values_types_in_the_record() {
        let body = r#"{"sku": "SKU-1", "price": {"amount": 1299.5}, "tags": ["a", 2],
            "stock": 4, "odd": {"$where": "x"}}"#;
        let (key, fields) = read("https://shop.test/api/product/1", body)
            .record
            .unwrap()
            .unwrap();
        assert_eq!(key, "SKU-1");
        assert_eq!(fields.get("price"), Some(&Bson::Double(1299.5)));
        assert_eq!(fields.get("stock"), Some(&Bson::Int64(4)));
        assert_eq!(
            fields.get("tags"),
            Some(&Bson::Array(vec![Bson::String("a".into()), Bson::Int64(2)]))
        );
        assert_eq!(fields.get("missing"), Some(&Bson::Null));
        assert_eq!(
            fields.get("odd"),
            Some(&Bson::String("{\"$where\":\"x\"}".into())),
            "an object with an operator-like key is stored as its text"
        );
        let numeric = read("https://shop.test/api/product/2", r#"{"sku": 42}"#);
        assert_eq!(numeric.record.unwrap().unwrap().0, "42");
        let keyless = read("https://shop.test/api/product/3", r#"{"name": "x"}"#);
        assert_eq!(
            keyless.record.unwrap().unwrap_err(),
            "no natural key ($.sku) on the page"
        );
    }

    #[test]
    fn broken_json_and_json_no_rule_matches_fail_the_page_with_the_reason() {
        let broken = read("https://shop.test/api/products", r#"{"products": [1, }"#);
        let why = broken.record.unwrap().unwrap_err();
        assert!(why.starts_with("not valid JSON ("), "{why}");
        let other = read("https://shop.test/api/other", r#"{"something": "else"}"#);
        assert_eq!(
            other.record.unwrap().unwrap_err(),
            "a JSON page that no JSONPath rule of the bot matches (follow $.next, follow $.related, list.item $.products[*])"
        );
        // A null `next` is a match: the last page of a listing, with no items left.
        let last = read(
            "https://shop.test/api/products?page=9",
            r#"{"products": [], "next": null}"#,
        );
        assert!(last.record.is_none() && last.links.is_empty());
        let mut html_only = links();
        html_only.follow_json.clear();
        let url = Url::parse("https://shop.test/x.json").unwrap();
        let data = extract(&url, "[1, 2]", BodyFormat::Json, &html_only, None, None);
        assert_eq!(
            data.record.unwrap().unwrap_err(),
            "a JSON page, and the bot has no JSONPath rule (`$…`) for one"
        );
    }

    #[test]
    fn a_json_page_with_a_hundred_thousand_items_yields_at_most_max_links() {
        let mut rules = links();
        rules.max = 1_000;
        let items: Vec<String> = (0..100_000)
            .map(|i| format!(r#"{{"id": {i}, "url": "/p/{i}"}}"#))
            .collect();
        let body = format!(r#"{{"products": [{}]}}"#, items.join(","));
        let url = Url::parse("https://shop.test/api/products").unwrap();
        let data = extract(&url, &body, BodyFormat::Json, &rules, Some(&list()), None);
        assert_eq!(data.items.len(), 1_000);
        assert_eq!(data.dropped, 99_000);
    }

    #[test]
    fn content_types_name_the_format() {
        for (essence, format) in [
            ("text/html", Some(BodyFormat::Html)),
            ("", Some(BodyFormat::Html)),
            ("application/json", Some(BodyFormat::Json)),
            ("application/ld+json", Some(BodyFormat::Json)),
            ("application/vnd.api+json", Some(BodyFormat::Json)),
            ("text/plain", None),
            ("application/xml", Some(BodyFormat::Sitemap)),
            ("text/xml", Some(BodyFormat::Sitemap)),
            ("application/x-gzip", Some(BodyFormat::Sitemap)),
            ("image/png", None),
            ("+json", None),
            ("+xml", None),
        ] {
            assert_eq!(BodyFormat::of_content_type(essence), format, "{essence}");
        }
    }
}
