//! `seedlock try`: one page as the crawl sees it. [`fetch`] asks for it as a crawl worker
//! would (the bot's headers, robots.txt, each redirect judged by [`next_hop`]); [`examine`]
//! reads it with the crawl's own [`extract`] and says, beside what the crawl would take, what
//! it would not (links refused, with why) and which selector matched nothing.

use bson::Bson;
use scraper::selector::ToCss;
use scraper::{Html, Selector};
use serde::Serialize;
use url::Url;

use crate::config::CrawlSettings;
use crate::extract::{extract, BodyFormat, HtmlRead, Pick};
use crate::flow::robots::{RobotsCache, Verdict};
use crate::http_client::{next_hop, FetchOutcome, HttpClient, Page, Validators};
use crate::store::frontier::fingerprint_hash;
use crate::store::records::{content_hash, record_id};
use crate::urls::NormalizedUrl;

/// A redirect followed on the way to the page.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Hop {
    pub status: u16,
    pub from: String,
    pub to: String,
}

/// Fetches `url` as the crawl would: robots.txt on every hop (unless `robots` is disabled),
/// every redirect checked against the bot's scope before it is requested. `Err` is why the
/// crawl would get no page (the reason the frontier would record).
pub(crate) async fn fetch(
    fetcher: &HttpClient,
    robots: &RobotsCache,
    rules: &CrawlSettings,
    url: &NormalizedUrl,
) -> (Vec<Hop>, Result<Page, String>) {
    let mut hops = Vec::new();
    let mut at = url.clone();
    for hop in 0.. {
        match robots.check(fetcher, &at).await {
            Verdict::Allowed { .. } => {}
            Verdict::Disallowed => return (hops, Err(format!("disallowed by robots.txt: {at}"))),
            Verdict::Unavailable { reason } => return (hops, Err(reason)),
        }
        let outcome = fetcher.fetch_one(&at, &Validators::default()).await;
        let reason = match outcome {
            FetchOutcome::Ok(page) => return (hops, Ok(page)),
            FetchOutcome::Redirect { status, to } => {
                hops.push(Hop {
                    status,
                    from: at.to_string(),
                    to: to.to_string(),
                });
                if let Err(reason) = next_hop(&rules.links, hop, &to) {
                    return (hops, Err(reason));
                }
                at = to;
                continue;
            }
            FetchOutcome::NotModified => "HTTP 304 to an unconditional request".to_owned(),
            FetchOutcome::Skipped { reason } => reason,
            FetchOutcome::Throttled {
                status,
                retry_after,
            } => match retry_after {
                Some(wait) => format!("HTTP {status}: throttled (Retry-After {wait:?})"),
                None => format!("HTTP {status}: throttled"),
            },
            FetchOutcome::Timeout => "timed out".to_owned(),
            FetchOutcome::Gone { status } => format!("HTTP {status}: gone"),
            FetchOutcome::Permanent { reason } | FetchOutcome::Transient { reason } => reason,
        };
        return (hops, Err(reason));
    }
    unreachable!("every hop returns or goes on")
}

/// The record a fetched detail page yields by the bot's rules (its natural key and fields, as the
/// crawl would store them), or why it yields none.
pub(crate) fn record_of(
    rules: &CrawlSettings,
    page: &Page,
) -> Result<(String, bson::Document), String> {
    let Some(record) = rules.record.as_ref() else {
        return Err("the bot has no [bots.crawl.record] rules".into());
    };
    if page.format == BodyFormat::Sitemap {
        return Err("a sitemap, not a detail page".into());
    }
    extract(
        &page.url.to_url(),
        &page.body,
        page.format,
        &rules.links,
        None,
        Some(record),
    )
    .record
    .unwrap_or_else(|| Err("no record".into()))
}

/// Which kind of page this is by the bot's rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Kind {
    Seed,
    Listing,
    Detail,
}

/// One listing item as the crawl reads it.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub(crate) struct ItemView {
    pub id: String,
    /// Its detail page, when `list.item_link` gave an in-scope URL.
    pub link: Option<String>,
    /// Each `list.fingerprint` spec with the value it read ("" when it matched nothing).
    pub fingerprint_fields: Vec<FingerprintField>,
    /// The 64-bit fingerprint a listing manifest keeps, in hex.
    pub fingerprint: String,
    /// `list.updated_at` as read, and as understood (RFC 3339).
    pub updated_at: Option<String>,
    pub updated_at_parsed: Option<String>,
}

/// One value of an item's fingerprint.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub(crate) struct FingerprintField {
    pub spec: String,
    pub value: String,
}

/// A link the crawl would not follow, and why.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub(crate) struct Refused {
    pub link: String,
    pub why: String,
}

/// The record of a detail page.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub(crate) struct RecordView {
    pub natural_key: String,
    /// `records._id`.
    pub id: String,
    /// Each field: its value, or `None` when its selector matched nothing (stored as null).
    pub fields: std::collections::BTreeMap<String, Option<String>>,
    pub content_hash: String,
}

/// A selector that found nothing: its config key, the spec, and where it was looked for.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub(crate) struct Unmatched {
    pub key: String,
    pub selector: String,
    pub detail: String,
}

/// Links refused are listed up to this many; the rest are counted.
pub const MAX_REFUSED_SHOWN: usize = 200;

/// What the crawl would take from a page, and what it would leave.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Examined {
    pub kind: Kind,
    /// Listing items (listing and seed pages with `[bots.crawl.list]`).
    pub items: Vec<ItemView>,
    /// Links the crawl follows, in page order.
    pub follows: Vec<String>,
    /// Links it does not follow (at most [`MAX_REFUSED_SHOWN`]), and how many more.
    pub refused: Vec<Refused>,
    pub refused_more: usize,
    /// Links and items past `max_links`.
    pub over_max_links: usize,
    /// A detail page's record…
    pub record: Option<RecordView>,
    /// …or why it has none.
    pub no_record: Option<String>,
    pub unmatched: Vec<Unmatched>,
    /// Whether the page yields what its kind needs; `verdict` says what it yields or lacks.
    pub ok: bool,
    pub verdict: String,
}

/// The page's kind: a detail page when `record.match` matches its URL, a seed when it is one
/// of `seeds`, else a listing page (as the crawl decides for a followed link).
pub(crate) fn kind_of(rules: &CrawlSettings, url: &NormalizedUrl, seeds: &[NormalizedUrl]) -> Kind {
    match &rules.record {
        Some(r) if r.url_match.is_match(url.as_str()) => Kind::Detail,
        _ if seeds.contains(url) => Kind::Seed,
        _ => Kind::Listing,
    }
}

/// A page as `try` has it: its text and format, or a sitemap file read as it arrived.
pub(crate) enum Body<'a> {
    Text(&'a str, BodyFormat),
    Sitemap(&'a crate::extract::sitemap::Sitemap),
}

/// Reads `body` (fetched from `page_url`) as the crawl would a page of `kind`.
pub(crate) fn examine(
    bot: &str,
    rules: &CrawlSettings,
    kind: Kind,
    page_url: &Url,
    body: Body<'_>,
) -> Examined {
    let listing = kind != Kind::Detail;
    let list = rules.list.as_ref().filter(|_| listing);
    let record = rules.record.as_ref().filter(|_| !listing);
    // What the crawl takes: its own extraction.
    let sitemap_data = |read: crate::extract::sitemap::Sitemap| {
        crate::extract::sitemap::page_data(page_url, read, &rules.links, rules.record.as_ref())
    };
    let (body, format, data) = match body {
        Body::Text(text, BodyFormat::Sitemap) => (
            text,
            BodyFormat::Sitemap,
            match crate::extract::sitemap::read(text.as_bytes()) {
                Ok(read) => sitemap_data(read),
                Err(e) => crate::extract::PageData {
                    record: Some(Err(e.to_string())),
                    ..Default::default()
                },
            },
        ),
        Body::Text(text, format) => (
            text,
            format,
            extract(page_url, text, format, &rules.links, list, record),
        ),
        Body::Sitemap(read) => ("", BodyFormat::Sitemap, sitemap_data(read.clone())),
    };
    let mut unmatched = Unmatches::default();
    // Beside it, what only an HTML page can say: the links refused, and each selector that
    // matched nothing.
    let sitemap = format == BodyFormat::Sitemap;
    let (items, refused) = match format {
        BodyFormat::Json => (json_items(list, &data), RefusedLinks::default()),
        BodyFormat::Sitemap => (sitemap_items(&data), RefusedLinks::default()),
        BodyFormat::Html => {
            let document = Html::parse_document(body);
            let root = document.root_element();
            let links = refused_links(&rules.links, page_url, root, &mut unmatched);
            let items = list.map_or_else(Vec::new, |l| list_items(l, root, &data, &mut unmatched));
            if let Some(key) = record.and_then(|r| r.natural_key.html.as_ref()) {
                if matches!(key.text(root), Ok(None)) {
                    unmatched.nothing(
                        "crawl.record.natural_key",
                        &key.describe(),
                        "matched nothing on the page: no record".into(),
                    );
                }
            }
            (items, links)
        }
    };
    let record = match (record, data.record) {
        (Some(r), Some(Ok((natural_key, fields)))) => Ok(Some(record_view(
            bot,
            r,
            natural_key,
            &fields,
            &mut unmatched,
        ))),
        // The page fails as the crawl would fail it: no record, broken embedded JSON, a JSON
        // page no rule reads.
        (_, Some(Err(why))) => Err(why),
        (Some(_), None) => Err("the page matched no record rule".into()),
        (None, _) => Ok(None),
    };
    let follows: Vec<String> = data.links.iter().map(ToString::to_string).collect();
    let (mut ok, mut verdict) = verdict(kind, list.is_some() || sitemap, &items, &follows, &record);
    if let (Err(why), false) = (&record, kind == Kind::Detail) {
        (ok, verdict) = (false, why.clone());
    }
    Examined {
        kind,
        items,
        follows,
        refused: refused.refused,
        refused_more: refused.more,
        over_max_links: data.dropped,
        no_record: record.as_ref().err().cloned(),
        record: record.ok().flatten(),
        unmatched: unmatched.0,
        ok,
        verdict,
    }
}

/// A sitemap's pages as the crawl keeps them: each one's link is its id, its `lastmod` its
/// fingerprint (none: fetched every pass).
fn sitemap_items(data: &crate::extract::PageData) -> Vec<ItemView> {
    data.items
        .iter()
        .map(|item| ItemView {
            id: item
                .url
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            link: item.url.as_ref().map(ToString::to_string),
            fingerprint_fields: vec![FingerprintField {
                spec: "lastmod".into(),
                value: if item.unversioned {
                    "(none: fetched every pass)".into()
                } else {
                    item.fingerprint.clone()
                },
            }],
            fingerprint: format!("{:016x}", fingerprint_hash(&item.fingerprint)),
            updated_at: item.updated_at.map(|t| t.to_rfc3339()),
            updated_at_parsed: item.updated_at.map(|t| t.to_rfc3339()),
        })
        .collect()
}

/// A JSON page's items as the crawl keeps them, each fingerprint value beside its JSONPath.
fn json_items(
    list: Option<&crate::extract::ListRules>,
    data: &crate::extract::PageData,
) -> Vec<ItemView> {
    let rules = list.map_or(&[][..], |l| l.fingerprint_json.as_slice());
    data.items
        .iter()
        .map(|item| ItemView {
            id: item.id.clone(),
            link: item.url.as_ref().map(ToString::to_string),
            fingerprint_fields: rules
                .iter()
                .zip(item.fingerprint.split('\u{1f}'))
                .map(|(rule, value)| FingerprintField {
                    spec: rule.as_str().to_owned(),
                    value: value.to_owned(),
                })
                .collect(),
            fingerprint: format!("{:016x}", fingerprint_hash(&item.fingerprint)),
            updated_at: item.updated_at.map(|t| t.to_rfc3339()),
            updated_at_parsed: item.updated_at.map(|t| t.to_rfc3339()),
        })
        .collect()
}

/// The selectors that matched nothing, each with its config key and what it missed.
#[derive(Default)]
struct Unmatches(Vec<Unmatched>);

impl Unmatches {
    fn nothing(&mut self, key: &str, selector: &str, detail: String) {
        self.0.push(Unmatched {
            key: key.to_owned(),
            selector: selector.to_owned(),
            detail,
        });
    }
}

/// The links a page's follow selector matched that the crawl does not follow.
#[derive(Default)]
struct RefusedLinks {
    /// At most [`MAX_REFUSED_SHOWN`], with why.
    refused: Vec<Refused>,
    /// How many more.
    more: usize,
}

/// Every link the follow selector matched: followed, or refused with why (out of scope, allow,
/// deny, duplicate, not a URL; those past `max_links` are counted by the extraction).
fn refused_links(
    links: &crate::extract::LinkRules,
    page_url: &Url,
    root: scraper::ElementRef<'_>,
    unmatched: &mut Unmatches,
) -> RefusedLinks {
    let mut out = RefusedLinks {
        refused: Vec::new(),
        more: 0,
    };
    let mut refuse = |link: String, why: String| {
        if out.refused.len() < MAX_REFUSED_SHOWN {
            out.refused.push(Refused { link, why });
        } else {
            out.more += 1;
        }
    };
    let Some(follow) = &links.follow else {
        return out;
    };
    let mut seen = std::collections::HashSet::new();
    let mut anchors = 0usize;
    let mut followed = 0usize;
    for a in root.select(follow) {
        anchors += 1;
        let Some(href) = a.value().attr("href") else {
            continue;
        };
        if followed >= links.max {
            continue; // counted in `data.dropped`
        }
        match NormalizedUrl::join_with(page_url, href, &links.strip) {
            Err(e) => refuse(href.to_owned(), format!("not a followable URL ({e})")),
            Ok(url) => match links.refusal(&url) {
                Some(why) => refuse(url.to_string(), why),
                None if !seen.insert(url.clone()) => refuse(url.to_string(), "duplicate".into()),
                None => followed += 1,
            },
        }
    }
    if anchors == 0 {
        unmatched.nothing(
            "crawl.follow",
            &css_of(follow),
            "matched no element on the page".into(),
        );
    }
    out
}

/// A listing page's items as the crawl keeps them, with what each selector read; a selector
/// that missed in some items (or a time that does not read) goes to `unmatched`.
fn list_items(
    l: &crate::extract::ListRules,
    root: scraper::ElementRef<'_>,
    data: &crate::extract::PageData,
    unmatched: &mut Unmatches,
) -> Vec<ItemView> {
    let (Some(item), Some(item_id)) = (&l.item.html, &l.item_id.html) else {
        return Vec::new();
    };
    let elements: Vec<_> = root.select(item).collect();
    if elements.is_empty() {
        unmatched.nothing(
            "crawl.list.item",
            &css_of(item),
            "matched no element on the page".into(),
        );
        return Vec::new();
    }
    let total = elements.len();
    let read = |spec: &HtmlRead, e: scraper::ElementRef<'_>| spec.text(e).ok().flatten();
    let mut in_items = |key: String, spec: &HtmlRead| {
        let n = elements
            .iter()
            .filter(|e| read(spec, **e).is_none())
            .count();
        if n > 0 {
            unmatched.nothing(
                &key,
                &spec.describe(),
                format!("matched nothing in {n} of {total} items"),
            );
        }
    };
    in_items("crawl.list.item_id".into(), item_id);
    if let Some(spec) = &l.item_link.html {
        in_items("crawl.list.item_link".into(), spec);
    }
    for (i, spec) in l.fingerprint.iter().enumerate() {
        in_items(format!("crawl.list.fingerprint[{i}]"), spec);
    }
    if let Some(spec) = &l.updated_at.html {
        in_items("crawl.list.updated_at".into(), spec);
        let unreadable = elements
            .iter()
            .filter_map(|e| read(spec, *e))
            .filter(|raw| crate::extract::parse_time(raw).is_none())
            .count();
        if unreadable > 0 {
            unmatched.nothing(
                "crawl.list.updated_at",
                &spec.describe(),
                format!("{unreadable} of {total} values are not an RFC 3339 or HTTP date"),
            );
        }
    }
    // The items the crawl keeps (those with an id, up to max_links), beside their elements: the
    // same selection, in the same order.
    let with_id = elements.iter().filter(|e| read(item_id, **e).is_some());
    with_id
        .zip(&data.items)
        .map(|(element, item)| ItemView {
            id: item.id.clone(),
            link: item.url.as_ref().map(ToString::to_string),
            fingerprint_fields: l
                .fingerprint
                .iter()
                .map(|spec| FingerprintField {
                    spec: spec.describe(),
                    value: read(spec, *element).unwrap_or_default(),
                })
                .collect(),
            fingerprint: format!("{:016x}", fingerprint_hash(&item.fingerprint)),
            updated_at: l
                .updated_at
                .html
                .as_ref()
                .and_then(|spec| read(spec, *element)),
            updated_at_parsed: item.updated_at.map(|t| t.to_rfc3339()),
        })
        .collect()
}

/// A detail page's record as it would be stored; a field that matched nothing (stored as null)
/// goes to `unmatched`.
fn record_view(
    bot: &str,
    r: &crate::extract::RecordRules,
    natural_key: String,
    fields: &bson::Document,
    unmatched: &mut Unmatches,
) -> RecordView {
    let mut shown = std::collections::BTreeMap::new();
    for (name, spec) in &r.fields {
        let value = match fields.get(name) {
            None | Some(Bson::Null) => None,
            Some(Bson::String(v)) => Some(v.clone()),
            Some(other) => Some(other.clone().into_relaxed_extjson().to_string()),
        };
        if value.is_none() {
            unmatched.nothing(
                &format!("crawl.record.fields.{name}"),
                &pick_str(&spec.pick),
                "matched nothing on the page (stored as null)".into(),
            );
        }
        shown.insert(name.clone(), value);
    }
    RecordView {
        id: record_id(bot, &natural_key),
        natural_key,
        content_hash: content_hash(fields),
        fields: shown,
    }
}

/// Whether the page yields what its kind needs, and a line saying what it yields or lacks.
fn verdict(
    kind: Kind,
    has_list_rules: bool,
    items: &[ItemView],
    follows: &[String],
    record: &Result<Option<RecordView>, String>,
) -> (bool, String) {
    let linked_items = items.iter().filter(|i| i.link.is_some()).count();
    let yields = || {
        format!(
            "{} items ({linked_items} with a detail link), {} links to follow",
            items.len(),
            follows.len()
        )
    };
    match kind {
        Kind::Detail => match record {
            Ok(Some(r)) => (true, format!("a record: {}", r.natural_key)),
            Err(why) => (false, format!("no record: {why}")),
            Ok(None) => (
                false,
                "no [bots.crawl.record] rules: nothing to store".into(),
            ),
        },
        Kind::Listing if has_list_rules => (linked_items > 0, yields()),
        _ => (linked_items > 0 || !follows.is_empty(), yields()),
    }
}

/// A key's entries as written: its CSS entry, its JSONPath entry, or both.
fn pick_str(pick: &Pick<HtmlRead>) -> String {
    let entries: Vec<String> = pick
        .html
        .iter()
        .map(HtmlRead::describe)
        .chain(pick.json.iter().map(|j| j.as_str().to_owned()))
        .collect();
    entries.join(" | ")
}

fn css_of(selector: &Selector) -> String {
    selector.to_css_string()
}
