//! Selector keys as a bot writes them: a string (a CSS selector, or a JSONPath when it starts
//! with `$`), a table naming where the value is and how to read it, or a list of these — one
//! entry for HTML pages, one for JSON pages.
//!
//! A table: `{ css = ".price" }`, `{ path = "$.price.amount" }` (a JSON page),
//! `{ jsonld = "Product", path = "$.offers.price" }` or
//! `{ css = "script#__NEXT_DATA__", path = "$.props.pageProps.sku" }` (JSON embedded in an HTML
//! page); a record field's table may add `type`, `all` and `required`.

use std::collections::BTreeMap;

use scraper::Selector;
use serde::{Deserialize, Serialize};

use crate::extract::{
    is_json_path, selector, Field, HtmlRead, JsonRule, Pick, ValueSpec, ValueType,
};

#[derive(Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub(crate) enum RawSelectors {
    One(RawEntry),
    Many(Vec<RawEntry>),
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub(crate) enum RawEntry {
    Text(String),
    Table(BTreeMap<String, RawOption>),
}

/// A table's value: `all`/`required` are flags, the others text.
#[derive(Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub(crate) enum RawOption {
    Flag(bool),
    Text(String),
}

impl From<&str> for RawEntry {
    fn from(s: &str) -> Self {
        Self::Text(s.to_owned())
    }
}

impl From<&str> for RawSelectors {
    fn from(s: &str) -> Self {
        Self::One(RawEntry::Text(s.to_owned()))
    }
}

impl RawSelectors {
    fn entries(&self) -> Vec<&RawEntry> {
        match self {
            Self::One(e) => vec![e],
            Self::Many(list) => list.iter().collect(),
        }
    }
}

/// How a record field's value is read (a table's `type`, `all`, `required`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Options {
    ty: Option<ValueType>,
    all: bool,
    required: bool,
}

/// One entry: what it reads on which kind of page.
enum Entry {
    Html(HtmlRead),
    Json(JsonRule),
}

const TABLE_KEYS: &str = "css, path, jsonld, type, all or required";

/// One entry read, with its table's options.
fn entry(raw: &RawEntry) -> Result<(Entry, Options), String> {
    let table = match raw {
        RawEntry::Text(s) if is_json_path(s) => {
            return Ok((Entry::Json(JsonRule::parse(s)?), Options::default()))
        }
        RawEntry::Text(s) => {
            return Ok((
                Entry::Html(HtmlRead::Css(ValueSpec::parse(s)?)),
                Options::default(),
            ))
        }
        RawEntry::Table(table) => table,
    };
    let mut text = BTreeMap::new();
    let mut options = Options::default();
    for (k, v) in table {
        match (k.as_str(), v) {
            ("all", RawOption::Flag(b)) => options.all = *b,
            ("required", RawOption::Flag(b)) => options.required = *b,
            ("all" | "required", RawOption::Text(_)) => {
                return Err(format!("`{k}` is true or false"))
            }
            ("type", RawOption::Text(t)) => options.ty = Some(ValueType::parse(t)?),
            ("css" | "path" | "jsonld", RawOption::Text(t)) => {
                text.insert(k.as_str(), t.as_str());
            }
            ("css" | "path" | "jsonld" | "type", RawOption::Flag(_)) => {
                return Err(format!("`{k}` is a string"))
            }
            (other, _) => {
                return Err(format!(
                    "{other:?} is not a key of a selector table ({TABLE_KEYS})"
                ))
            }
        }
    }
    let path = text.get("path").map(|p| JsonRule::parse(p)).transpose()?;
    let read = match (text.get("css"), path, text.get("jsonld")) {
        (Some(_), _, Some(_)) => return Err("`css` and `jsonld` do not go together".into()),
        (Some(css), None, None) => Entry::Html(HtmlRead::Css(ValueSpec::parse(css)?)),
        (Some(css), Some(path), None) => Entry::Html(HtmlRead::InElement {
            selector: selector(css)?,
            css: (*css).to_owned(),
            path,
        }),
        (None, path, Some(of_type)) => Entry::Html(HtmlRead::JsonLd {
            of_type: (*of_type).to_owned(),
            path: path.map_or_else(|| JsonRule::parse("$"), Ok)?,
        }),
        (None, Some(path), None) => Entry::Json(path),
        (None, None, None) => {
            return Err(format!(
            "a selector table names where the value is: `css`, `path` or `jsonld` ({TABLE_KEYS})"
        ))
        }
    };
    Ok((read, options))
}

/// A key's entries as one HTML entry and one JSON entry at most, with their options (which
/// must agree when several tables give them).
fn pick(key: &str, raw: &RawSelectors) -> Result<(Pick<HtmlRead>, Options), String> {
    let named = |e: String| format!("key `{key}`: {e}");
    let mut out = Pick {
        html: None,
        json: None,
    };
    let mut options: Option<Options> = None;
    let entries = raw.entries();
    for raw_entry in &entries {
        let (read, these) = entry(raw_entry).map_err(named)?;
        if matches!(raw_entry, RawEntry::Table(_)) {
            match options {
                Some(o) if o != these => {
                    return Err(named(
                        "its tables disagree on `type`, `all` or `required`".into(),
                    ))
                }
                _ => options = Some(these),
            }
        }
        let taken = match read {
            Entry::Html(h) => out.html.replace(h).is_some(),
            Entry::Json(j) => out.json.replace(j).is_some(),
        };
        if taken {
            return Err(named(
                "give one entry for HTML pages and one (`$…`) for JSON pages at most".into(),
            ));
        }
    }
    if out.is_empty() {
        return Err(named("name at least one selector".into()));
    }
    Ok((out, options.unwrap_or_default()))
}

/// A key that reads one value (`list.item_id`, `list.item_link`, `list.updated_at`,
/// `record.natural_key`): no `type`, `all` or `required`, which belong to record fields.
pub(super) fn value(key: &str, raw: &RawSelectors) -> Result<Pick<HtmlRead>, String> {
    let (read, options) = pick(key, raw)?;
    if options != Options::default() {
        return Err(format!(
            "key `{key}`: `type`, `all` and `required` apply to record fields only"
        ));
    }
    Ok(read)
}

/// A record field: its entries and how it is read.
pub(super) fn field(key: &str, raw: &RawSelectors) -> Result<Field, String> {
    let (read, options) = pick(key, raw)?;
    Ok(Field {
        pick: read,
        ty: options.ty,
        all: options.all,
        required: options.required,
    })
}

/// The plain strings of a key that takes no table (`list.item`, `follow`): its CSS entries and
/// its JSONPath entries.
fn plain<'a>(key: &str, raw: &'a RawSelectors) -> Result<(Vec<&'a str>, Vec<&'a str>), String> {
    let mut css = Vec::new();
    let mut json = Vec::new();
    for e in raw.entries() {
        match e {
            RawEntry::Text(s) if is_json_path(s) => json.push(s.as_str()),
            RawEntry::Text(s) => css.push(s.as_str()),
            RawEntry::Table(_) => {
                return Err(format!(
                    "key `{key}`: a CSS selector or a JSONPath (`$…`), not a table"
                ))
            }
        }
    }
    Ok((css, json))
}

/// `list.item`: one CSS selector and one JSONPath at most.
pub(super) fn item(key: &str, raw: &RawSelectors) -> Result<Pick<Selector>, String> {
    let named = |e: String| format!("key `{key}`: {e}");
    let (css, json) = plain(key, raw)?;
    if css.len() > 1 || json.len() > 1 || css.is_empty() && json.is_empty() {
        return Err(named(
            "give one CSS selector, one JSONPath (`$…`), or a list of one of each".into(),
        ));
    }
    Ok(Pick {
        html: css
            .first()
            .map(|c| selector(c))
            .transpose()
            .map_err(named)?,
        json: json
            .first()
            .map(|j| JsonRule::parse(j))
            .transpose()
            .map_err(named)?,
    })
}

/// `follow`: its CSS entries as one selector list (page order), and its JSONPaths.
pub(super) fn follow(
    key: &str,
    raw: &RawSelectors,
) -> Result<(Option<Selector>, Vec<JsonRule>), String> {
    let named = |e: String| format!("key `{key}`: {e}");
    let (css, json) = plain(key, raw)?;
    for c in &css {
        selector(c).map_err(named)?;
    }
    let html = (!css.is_empty())
        .then(|| selector(&css.join(", ")))
        .transpose()
        .map_err(named)?;
    let json = json
        .into_iter()
        .map(|j| JsonRule::parse(j).map_err(named))
        .collect::<Result<_, _>>()?;
    Ok((html, json))
}

/// `list.fingerprint`: its HTML entries and its JSONPath entries, each as many as given.
pub(super) fn fingerprint(
    key: &str,
    raw: &[RawEntry],
) -> Result<(Vec<HtmlRead>, Vec<JsonRule>), String> {
    let mut html = Vec::new();
    let mut json = Vec::new();
    for e in raw {
        let (read, options) = entry(e).map_err(|e| format!("key `{key}`: {e}"))?;
        if options != Options::default() {
            return Err(format!(
                "key `{key}`: `type`, `all` and `required` apply to record fields only"
            ));
        }
        match read {
            Entry::Html(h) => html.push(h),
            Entry::Json(j) => json.push(j),
        }
    }
    Ok((html, json))
}
