//! What a crawl reads from a page, with a real HTML parser (`scraper`, CSS selectors) — never
//! regular expressions over HTML — or, for a JSON page, a JSON parser and JSONPath (RFC 9535,
//! `serde_json_path`: `json.rs`). Pure: a page's URL and body in, links, listing items and a
//! record out; the crawl loop decides what to fetch and store.

mod embedded;
mod json;
pub mod sitemap;
mod typed;

pub use embedded::HtmlRead;
pub use typed::ValueType;

use std::collections::{BTreeMap, HashMap};

use bson::{Bson, Document};
use scraper::{ElementRef, Html, Selector};
use url::Url;

use crate::urls::{NormalizedUrl, StripQuery};

/// How to read one value: `selector` (its text), `selector@attr` (an attribute of the first
/// match), or `@attr` (an attribute of the element itself).
#[derive(Clone, Debug)]
pub struct ValueSpec {
    raw: String,
    selector: Option<Selector>,
    attr: Option<String>,
}

impl ValueSpec {
    pub(crate) fn parse(raw: &str) -> Result<Self, String> {
        let raw = raw.trim();
        let (css, attr) = match raw.rsplit_once('@') {
            Some((css, attr)) if is_attr_name(attr) => (css.trim(), Some(attr.to_owned())),
            _ => (raw, None),
        };
        if css.is_empty() && attr.is_none() {
            return Err("an empty value spec; write a CSS selector, selector@attr or @attr".into());
        }
        let selector = if css.is_empty() {
            None
        } else {
            Some(selector(css)?)
        };
        Ok(Self {
            raw: raw.to_owned(),
            selector,
            attr,
        })
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.raw
    }

    /// The value inside `scope`: trimmed, inner white space collapsed; `None` when absent or empty.
    pub(crate) fn read(&self, scope: ElementRef<'_>) -> Option<String> {
        let element = match &self.selector {
            Some(selector) => scope.select(selector).next()?,
            None => scope,
        };
        self.value_of(element)
    }

    /// Every value inside `scope` (each match of the selector), empty ones left out.
    pub(crate) fn read_all(&self, scope: ElementRef<'_>) -> Vec<String> {
        match &self.selector {
            Some(selector) => scope
                .select(selector)
                .filter_map(|e| self.value_of(e))
                .collect(),
            None => self.value_of(scope).into_iter().collect(),
        }
    }

    /// One matched element's value: its attribute or its text, white space collapsed.
    fn value_of(&self, element: ElementRef<'_>) -> Option<String> {
        let value = match &self.attr {
            Some(attr) => element.value().attr(attr)?.to_owned(),
            None => element.text().collect::<String>(),
        };
        let value = collapse_whitespace(&value);
        (!value.is_empty()).then_some(value)
    }
}

/// `text` trimmed, each run of white space inside it one space.
fn collapse_whitespace(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for word in text.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(word);
    }
    out
}

fn is_attr_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || "_-:.".contains(c))
}

/// A JSONPath (RFC 9535) query as the bot wrote it: `$.products[*]`, `$.price.amount`.
#[derive(Clone, Debug)]
pub struct JsonRule {
    raw: String,
    path: serde_json_path::JsonPath,
}

impl JsonRule {
    pub(crate) fn parse(raw: &str) -> Result<Self, String> {
        let raw = raw.trim();
        let path = serde_json_path::JsonPath::parse(raw)
            .map_err(|e| format!("{raw:?} is not a JSONPath ({e})"))?;
        Ok(Self {
            raw: raw.to_owned(),
            path,
        })
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.raw
    }
}

/// Whether a selector string is a JSONPath (it starts with `$`) rather than CSS.
pub(crate) fn is_json_path(raw: &str) -> bool {
    raw.trim_start().starts_with('$')
}

/// One selector key of a bot, by the kind of page it reads: its CSS entry reads HTML pages, its
/// JSONPath entry (`$…`) JSON pages. Either may be absent: a bot may read only one kind.
#[derive(Clone, Debug)]
pub struct Pick<H> {
    pub html: Option<H>,
    pub json: Option<JsonRule>,
}

impl<H> Pick<H> {
    /// A key with a CSS entry only.
    pub fn html(html: H) -> Self {
        Self {
            html: Some(html),
            json: None,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.html.is_none() && self.json.is_none()
    }
}

/// A CSS selector, with the parser's complaint as the error.
pub(crate) fn selector(css: &str) -> Result<Selector, String> {
    Selector::parse(css).map_err(|e| format!("{css:?} is not a CSS selector ({e})"))
}

/// Listing pages: items with an id, a link to their detail page, and a fingerprint.
#[derive(Clone, Debug)]
pub struct ListRules {
    pub item: Pick<Selector>,
    /// Relative to the item, as are the other keys.
    pub item_id: Pick<HtmlRead>,
    pub item_link: Pick<HtmlRead>,
    /// The fingerprint's HTML entries…
    pub fingerprint: Vec<HtmlRead>,
    /// … and its JSONPath entries (JSON pages).
    pub fingerprint_json: Vec<JsonRule>,
    /// Where an item shows when it last changed (`updated_at` mode), RFC 3339 or an HTTP date
    /// (in JSON also a number of Unix seconds).
    pub updated_at: Pick<HtmlRead>,
}

/// Detail pages: one record each.
#[derive(Clone, Debug)]
pub struct RecordRules {
    pub url_match: regex::Regex,
    pub natural_key: Pick<HtmlRead>,
    pub fields: BTreeMap<String, Field>,
}

/// One record field: where its value is, and how to read it.
#[derive(Clone, Debug)]
pub struct Field {
    pub pick: Pick<HtmlRead>,
    /// `None`: a CSS match is stored as a string, JSON as its own type.
    pub ty: Option<ValueType>,
    /// Every match, as an array.
    pub all: bool,
    /// A page without the value (or whose value does not read as `ty`) fails.
    pub required: bool,
}

impl Field {
    /// A field read as text with a CSS entry only, optional: the plain form.
    pub fn css(spec: ValueSpec) -> Self {
        Self {
            pick: Pick::html(HtmlRead::Css(spec)),
            ty: None,
            all: false,
            required: false,
        }
    }

    /// The field's stored value from what its entry read (`css`: a CSS match, kept as text
    /// when no type is set), or why the page fails.
    pub(crate) fn store(&self, values: Vec<serde_json::Value>, css: bool) -> Result<Bson, String> {
        if values.is_empty() {
            if self.required {
                return Err("required, and nothing on the page matched".into());
            }
            return Ok(if self.all {
                Bson::Array(Vec::new())
            } else {
                Bson::Null
            });
        }
        let one = |value: &serde_json::Value| -> Result<Bson, String> {
            match (self.ty, value) {
                (Some(ty), _) => match ty.convert(value) {
                    Ok(v) => Ok(v),
                    Err(e) if self.required => Err(e),
                    Err(_) => Ok(Bson::Null),
                },
                (None, serde_json::Value::String(s)) if css => Ok(Bson::String(s.clone())),
                (None, _) => Ok(json::to_bson(value, 0)),
            }
        };
        if self.all {
            values
                .iter()
                .map(one)
                .collect::<Result<Vec<_>, _>>()
                .map(Bson::Array)
        } else {
            one(&values[0])
        }
    }
}

/// Which links a crawl follows.
#[derive(Clone, Debug)]
pub struct LinkRules {
    /// `host:port` pairs links may lead to.
    pub scope: Vec<String>,
    /// The links an HTML page's elements hold (`href`): the CSS entries of `follow`, as one
    /// selector list.
    pub follow: Option<Selector>,
    /// The URLs a JSON page's values hold (strings, or arrays of them): `follow`'s JSONPath
    /// entries.
    pub follow_json: Vec<JsonRule>,
    pub allow: Vec<regex::Regex>,
    pub deny: Vec<regex::Regex>,
    pub strip: StripQuery,
    /// Links, and listing items, read from one page at most (`bots.crawl.max_links`); the rest
    /// are counted in [`PageData::dropped`].
    pub max: usize,
    /// A URL longer than this (bytes) is a crawl trap (`bots.crawl.max_url_length`).
    pub max_url_length: usize,
}

/// A crawl-trap bound: what drops a URL the rules would otherwise follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// More links from a seed than `max_depth`.
    Depth,
    /// Longer than `max_url_length`.
    UrlLength,
    /// A path that repeats one segment more than [`MAX_SEGMENT_REPEATS`] times.
    RepeatedSegment,
    /// The pass holds `max_pages` pages.
    MaxPages,
    /// The pass holds `max_pages_per_host` pages of the URL's host.
    MaxPagesPerHost,
}

/// A path segment may appear this many times in one path; once more is a trap (`/a/b/a/b/a/b/a/b`).
pub const MAX_SEGMENT_REPEATS: usize = 3;

impl Bound {
    pub const ALL: [Bound; 5] = [
        Bound::Depth,
        Bound::UrlLength,
        Bound::RepeatedSegment,
        Bound::MaxPages,
        Bound::MaxPagesPerHost,
    ];

    /// The bound's name: its config key, or the rule.
    pub fn as_str(self) -> &'static str {
        match self {
            Bound::Depth => "max_depth",
            Bound::UrlLength => "max_url_length",
            Bound::RepeatedSegment => "repeated_segment",
            Bound::MaxPages => "max_pages",
            Bound::MaxPagesPerHost => "max_pages_per_host",
        }
    }

    /// Whether a pass that hit it is incomplete (it left pages of the site uncrawled): no
    /// removals follow from it.
    pub fn cuts_the_pass_short(self) -> bool {
        matches!(self, Bound::MaxPages | Bound::MaxPagesPerHost)
    }
}

/// URLs dropped by each [`Bound`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dropped([u64; 5]);

impl Dropped {
    pub fn add(&mut self, bound: Bound, n: u64) {
        self.0[bound as usize] += n;
    }

    pub fn get(&self, bound: Bound) -> u64 {
        self.0[bound as usize]
    }

    pub fn merge(&mut self, other: &Dropped) {
        for bound in Bound::ALL {
            self.add(bound, other.get(bound));
        }
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|n| *n == 0)
    }

    /// The bounds that dropped something, with their counts.
    pub fn counts(&self) -> impl Iterator<Item = (Bound, u64)> + '_ {
        Bound::ALL
            .into_iter()
            .map(|b| (b, self.get(b)))
            .filter(|(_, n)| *n > 0)
    }
}

impl LinkRules {
    /// True when `url`'s `host:port` (or host) is one of `scope`.
    pub(crate) fn in_scope(&self, url: &NormalizedUrl) -> bool {
        let (host, port) = url.host_and_port();
        let here = format!("{host}:{port}");
        self.scope
            .iter()
            .any(|s| s.eq_ignore_ascii_case(&here) || s.eq_ignore_ascii_case(host))
    }

    /// True when `url` is on an in-scope host, passes the allow/deny patterns and is no trap.
    pub(crate) fn admits(&self, url: &NormalizedUrl) -> bool {
        self.refusal(url).is_none()
    }

    /// The trap bound a URL the rules admit hits by its shape (its length, a path segment
    /// repeated), if any.
    pub(crate) fn trap(&self, url: &NormalizedUrl) -> Option<Bound> {
        if url.as_str().len() > self.max_url_length {
            return Some(Bound::UrlLength);
        }
        let path = url.as_str().split(['?', '#']).next().unwrap_or("");
        let path = path.splitn(4, '/').nth(3).unwrap_or("");
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for segment in path.split('/').filter(|s| !s.is_empty()) {
            let n = counts.entry(segment).or_default();
            *n += 1;
            if *n > MAX_SEGMENT_REPEATS {
                return Some(Bound::RepeatedSegment);
            }
        }
        None
    }

    /// As [`LinkRules::admits`], counting a URL a trap bound drops into `dropped`.
    pub(crate) fn admits_counting(&self, url: &NormalizedUrl, dropped: &mut Dropped) -> bool {
        if self.refusal_by_rules(url).is_some() {
            return false;
        }
        match self.trap(url) {
            Some(bound) => {
                dropped.add(bound, 1);
                false
            }
            None => true,
        }
    }

    /// Why `url` is not followed: out of scope (its `host:port`), not matched by `allow`, or
    /// matched by a `deny` pattern; `None` when it is followed.
    pub(crate) fn refusal(&self, url: &NormalizedUrl) -> Option<String> {
        self.refusal_by_rules(url).or_else(|| {
            self.trap(url).map(|bound| match bound {
                Bound::UrlLength => {
                    format!("longer than max_url_length ({} bytes)", self.max_url_length)
                }
                _ => format!(
                    "a path segment repeats more than {MAX_SEGMENT_REPEATS} times (a crawl trap)"
                ),
            })
        })
    }

    /// Why the scope or the allow/deny patterns refuse `url`.
    fn refusal_by_rules(&self, url: &NormalizedUrl) -> Option<String> {
        if !self.in_scope(url) {
            return Some(format!("out of scope: {}", url.host_port()));
        }
        if !self.allow.is_empty() && !self.allow.iter().any(|r| r.is_match(url.as_str())) {
            return Some("matches no `allow` pattern".into());
        }
        self.deny
            .iter()
            .find(|r| r.is_match(url.as_str()))
            .map(|r| format!("denied by {:?}", r.as_str()))
    }
}

/// One item of a listing page.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ListItem {
    pub id: String,
    pub url: Option<NormalizedUrl>,
    /// The values the fingerprint names, joined: a change means the detail page changed.
    pub fingerprint: String,
    /// When the item says it last changed (`list.updated_at`), if it says so readably.
    pub updated_at: Option<chrono::DateTime<chrono::Utc>>,
    /// The item carries no change signal (a sitemap `<url>` without `<lastmod>`): its detail
    /// page is fetched every pass, as in `full` mode.
    pub unversioned: bool,
}

/// An item's change time: RFC 3339, or an HTTP date.
pub fn parse_time(raw: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    use chrono::{DateTime, Utc};
    DateTime::parse_from_rfc3339(raw.trim())
        .or_else(|_| DateTime::parse_from_rfc2822(&raw.trim().replace("GMT", "+0000")))
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// Everything read from one page.
#[derive(Clone, Debug, Default)]
pub(crate) struct PageData {
    /// Followable links, in scope, normalized, deduplicated, in page order.
    pub links: Vec<NormalizedUrl>,
    pub items: Vec<ListItem>,
    /// For a detail page: its natural key and fields, or why there is no record.
    pub record: Option<Result<(String, Document), String>>,
    /// Links and items past `max_links`, not followed.
    pub dropped: usize,
    /// A detail page's canonical URL (`<link rel="canonical">`, followable) when it is not the
    /// page's own: its record is stored under it.
    pub canonical: Option<NormalizedUrl>,
    /// Why the page fails though it was read (JSON embedded in it is broken, naming the key);
    /// [`extract`] moves it into `record`.
    pub page_error: Option<String>,
    /// Links the crawl-trap bounds of their shape dropped (length, repeated segments).
    pub bounded: Dropped,
}

/// What a page's body is written in, from its `Content-Type`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BodyFormat {
    #[default]
    Html,
    /// `application/json`, or any `…/…+json`.
    Json,
    /// XML (`application/xml`, `text/xml`, any `…/…+xml`) or a gzip file: read as a sitemap
    /// (`sitemap.rs`) when it is one, as a stream.
    Sitemap,
}

impl BodyFormat {
    /// The format of a `Content-Type`'s essence (lowercase, no parameters); `None`: neither.
    pub fn of_content_type(essence: &str) -> Option<Self> {
        match essence {
            "" | "text/html" | "application/xhtml+xml" => Some(Self::Html),
            "application/json" => Some(Self::Json),
            e if e.ends_with("+json") && e.contains('/') => Some(Self::Json),
            "application/xml" | "text/xml" | "application/gzip" | "application/x-gzip" => {
                Some(Self::Sitemap)
            }
            e if e.ends_with("+xml") && e.contains('/') => Some(Self::Sitemap),
            _ => None,
        }
    }
}

/// Reads a page written in `format`. `record` applies only when the page's URL matches
/// `record.url_match`. A JSON page that none of the bot's JSONPath rules matches comes back
/// with that reason as its record's error (the page is failed, never silently skipped).
pub(crate) fn extract(
    page_url: &Url,
    body: &str,
    format: BodyFormat,
    links: &LinkRules,
    list: Option<&ListRules>,
    record: Option<&RecordRules>,
) -> PageData {
    match format {
        BodyFormat::Html => extract_html(page_url, body, links, list, record),
        BodyFormat::Json => json::extract(page_url, body, links, list, record),
        BodyFormat::Sitemap => match sitemap::read(body.as_bytes()) {
            Ok(read) => sitemap::page_data(page_url, read, links, record),
            Err(e) => PageData {
                record: Some(Err(e.to_string())),
                ..PageData::default()
            },
        },
    }
}

fn extract_html(
    page_url: &Url,
    html: &str,
    links: &LinkRules,
    list: Option<&ListRules>,
    record: Option<&RecordRules>,
) -> PageData {
    let document = Html::parse_document(html);
    let root = document.root_element();
    let mut data = PageData::default();
    let mut resolver = Resolver::new(page_url, links);
    read_links(root, &mut resolver, &mut data);
    if let Some(rules) = list {
        read_items(root, rules, &resolver, &mut data);
    }
    if let Some(rules) = record.filter(|r| r.url_match.is_match(page_url.as_str())) {
        data.record = Some(read_record(root, rules));
        data.canonical = canonical(root, page_url, &resolver);
    }
    if let Some(why) = data.page_error.take() {
        data.record = Some(Err(why));
    }
    data.bounded = resolver.bounded();
    data
}

/// The page's `<link rel="canonical">`, resolved and followable (in scope, allowed), when it
/// names another URL than the page's own.
fn canonical(
    root: ElementRef<'_>,
    page_url: &Url,
    resolver: &Resolver<'_>,
) -> Option<NormalizedUrl> {
    static LINK: std::sync::OnceLock<Selector> = std::sync::OnceLock::new();
    let link = LINK.get_or_init(|| {
        Selector::parse(r#"link[rel~="canonical" i][href]"#).expect("a valid selector")
    });
    let href = root.select(link).next()?.value().attr("href")?;
    let url = resolver.follow(href.trim())?;
    let own = NormalizedUrl::join_with(page_url, "", &resolver.rules.strip).ok();
    (own.as_ref() != Some(&url)).then_some(url)
}

/// Each link as the page wrote it, resolved against the page and judged by the link rules once:
/// a listing item's link is usually one of the page's links too.
pub(super) struct Resolver<'a> {
    page_url: &'a Url,
    rules: &'a LinkRules,
    resolved: HashMap<&'a str, Option<NormalizedUrl>>,
    /// What the trap bounds dropped of the links resolved.
    bounded: std::cell::Cell<Dropped>,
}

impl<'a> Resolver<'a> {
    pub(super) fn new(page_url: &'a Url, rules: &'a LinkRules) -> Self {
        Self {
            page_url,
            rules,
            resolved: HashMap::new(),
            bounded: Default::default(),
        }
    }

    /// What the trap bounds dropped so far.
    pub(super) fn bounded(&self) -> Dropped {
        self.bounded.get()
    }

    /// `href` resolved, if it is followable.
    pub(super) fn follow(&self, href: &str) -> Option<NormalizedUrl> {
        if let Some(url) = self.resolved.get(href) {
            return url.clone();
        }
        let url = NormalizedUrl::join_with(self.page_url, href, &self.rules.strip).ok()?;
        let mut bounded = self.bounded.get();
        let admitted = self.rules.admits_counting(&url, &mut bounded);
        self.bounded.set(bounded);
        admitted.then_some(url)
    }
}

/// The followable links, in page order, deduplicated, at most `max` of them.
fn read_links<'a>(root: ElementRef<'a>, resolver: &mut Resolver<'a>, data: &mut PageData) {
    let Some(follow) = &resolver.rules.follow else {
        return;
    };
    let mut seen = std::collections::HashSet::new();
    for a in root.select(follow) {
        let Some(href) = a.value().attr("href") else {
            continue;
        };
        if data.links.len() >= resolver.rules.max {
            data.dropped += 1;
            continue;
        }
        if resolver.resolved.contains_key(href) {
            continue; // the same link again
        }
        let url = resolver.follow(href);
        resolver.resolved.insert(href, url.clone());
        if let Some(url) = url {
            if seen.insert(url.clone()) {
                data.links.push(url);
            }
        }
    }
}

/// A listing page's items, at most `max` of them.
fn read_items(root: ElementRef<'_>, rules: &ListRules, resolver: &Resolver, data: &mut PageData) {
    let (Some(selector), Some(item_id)) = (&rules.item.html, &rules.item_id.html) else {
        return;
    };
    for item in root.select(selector) {
        if data.items.len() >= resolver.rules.max {
            data.dropped += 1;
            continue;
        }
        let mut text = |key: &str, how: &HtmlRead| -> Option<String> {
            how.text(item).unwrap_or_else(|e| {
                data.page_error.get_or_insert(format!("{key}: {e}"));
                None
            })
        };
        let Some(id) = text("list.item_id", item_id) else {
            continue;
        };
        let url = rules
            .item_link
            .html
            .as_ref()
            .and_then(|how| text("list.item_link", how))
            .and_then(|href| resolver.follow(&href));
        let fingerprint = rules
            .fingerprint
            .iter()
            .map(|how| text("list.fingerprint", how).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\u{1f}");
        let updated_at = rules
            .updated_at
            .html
            .as_ref()
            .and_then(|how| text("list.updated_at", how))
            .and_then(|raw| parse_time(&raw));
        data.items.push(ListItem {
            id,
            url,
            fingerprint,
            updated_at,
            unversioned: false,
        });
    }
}

/// A detail page's natural key and fields, or why there is no record.
fn read_record(root: ElementRef<'_>, rules: &RecordRules) -> Result<(String, Document), String> {
    let Some(natural_key) = &rules.natural_key.html else {
        return Err(
            "no natural key: record.natural_key has no CSS selector for an HTML page".into(),
        );
    };
    let key = natural_key
        .text(root)
        .map_err(|e| format!("record.natural_key: {e}"))?;
    let Some(key) = key else {
        return Err(format!(
            "no natural key ({}) on the page",
            natural_key.describe()
        ));
    };
    let mut fields = Document::new();
    for (name, field) in &rules.fields {
        let named = |e: String| format!("record.fields.{name}: {e}");
        let (values, css) = match &field.pick.html {
            Some(how) => (
                how.values(root, field.all).map_err(named)?,
                matches!(how, HtmlRead::Css(_)),
            ),
            None => (Vec::new(), true),
        };
        fields.insert(name.clone(), field.store(values, css).map_err(named)?);
    }
    Ok((key, fields))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIST: &str = r#"<html><body>
      <div class="item" data-id="SKU-2"><a href="/product/SKU-2?utm_source=x"><span class="title">Lamp</span></a>
        <span class="price"> $1.00 </span><span class="status">in stock</span></div>
      <div class="item" data-id="SKU-1"><a href="/product/SKU-1"><span class="title">Mug</span></a>
        <span class="price">$2.00</span></div>
      <div class="item"><span class="price">no id</span></div>
      <a class="next" href="/list/2#top">next</a>
      <a href="http://elsewhere.test/x">off scope</a>
      <a href="/logout">deny me</a>
      <a href="mailto:x@y">mail</a>
      <a>no href</a>
    </body></html>"#;

    fn css(spec: &str) -> HtmlRead {
        HtmlRead::Css(ValueSpec::parse(spec).unwrap())
    }

    #[test]
    fn long_urls_and_repeated_path_segments_are_traps_counted_by_bound() {
        let (links, _, _) = rules();
        let url =
            |path: &str| NormalizedUrl::parse(&format!("http://shop.test:8080{path}")).unwrap();
        assert_eq!(
            links.trap(&url("/a/b/a/b/a/b")),
            None,
            "three times is fine"
        );
        assert_eq!(
            links.trap(&url("/a/b/a/b/a/b/a")),
            Some(Bound::RepeatedSegment)
        );
        assert_eq!(
            links.trap(&url("/x?q=/a/a/a/a")),
            None,
            "the query is not the path"
        );
        assert_eq!(
            links.trap(&url(&format!("/{}", "y".repeat(40)))),
            Some(Bound::UrlLength)
        );
        let page = Url::parse("http://shop.test:8080/list/1").unwrap();
        let html = format!(
            r#"<a href="/ok">a</a><a href="/a/a/a/a">b</a><a href="/{}">c</a><a href="/a/a/a/a">again</a>"#,
            "z".repeat(50)
        );
        let data = extract(&page, &html, BodyFormat::Html, &links, None, None);
        assert_eq!(data.links, [url("/ok")]);
        assert_eq!(
            data.bounded.get(Bound::RepeatedSegment),
            1,
            "each link once"
        );
        assert_eq!(data.bounded.get(Bound::UrlLength), 1);
        assert_eq!(
            links.refusal(&url("/a/a/a/a")).unwrap(),
            "a path segment repeats more than 3 times (a crawl trap)"
        );
    }

    fn rules() -> (LinkRules, ListRules, RecordRules) {
        let links = LinkRules {
            scope: vec!["shop.test:8080".into()],
            follow: Some(selector("a[href]").unwrap()),
            follow_json: vec![],
            allow: vec![],
            deny: vec![regex::Regex::new("/logout").unwrap()],
            strip: StripQuery::parse(&["utm_*".into()]).unwrap(),
            max: 10_000,
            max_url_length: 60,
        };
        let list = ListRules {
            item: Pick::html(selector(".item").unwrap()),
            item_id: Pick::html(css("@data-id")),
            item_link: Pick::html(css("a@href")),
            fingerprint: vec![css(".price"), css(".status")],
            fingerprint_json: vec![],
            updated_at: Pick {
                html: None,
                json: None,
            },
        };
        let record = RecordRules {
            url_match: regex::Regex::new("/product/").unwrap(),
            natural_key: Pick::html(css(".sku")),
            fields: [("title", "h1"), ("price", ".price")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), Field::css(ValueSpec::parse(v).unwrap())))
                .collect(),
        };
        (links, list, record)
    }

    #[test]
    fn listing_pages_yield_items_fingerprints_and_in_scope_links() {
        let (links, list, record) = rules();
        let page = Url::parse("http://shop.test:8080/list/1").unwrap();
        let data = extract(
            &page,
            LIST,
            BodyFormat::Html,
            &links,
            Some(&list),
            Some(&record),
        );
        let found: Vec<&str> = data.links.iter().map(|u| u.as_str()).collect();
        assert_eq!(
            found,
            [
                "http://shop.test:8080/product/SKU-2",
                "http://shop.test:8080/product/SKU-1",
                "http://shop.test:8080/list/2"
            ]
        );
        assert_eq!(data.items.len(), 2, "an item without an id is skipped");
        assert_eq!(data.items[0].id, "SKU-2");
        assert_eq!(
            data.items[0].url.as_ref().unwrap().as_str(),
            "http://shop.test:8080/product/SKU-2"
        );
        assert_eq!(
            data.items[0].fingerprint, "$1.00\u{1f}in stock",
            "trimmed values"
        );
        assert_eq!(
            data.items[1].fingerprint, "$2.00\u{1f}",
            "a missing value is empty, not a skip"
        );
        assert!(data.record.is_none(), "a listing URL is not a detail page");
    }

    #[test]
    fn detail_pages_yield_a_record_or_say_why_not() {
        let (links, _, record) = rules();
        let page = Url::parse("http://shop.test:8080/product/SKU-1").unwrap();
        let html = "<h1>Mug  deluxe</h1><div class=sku>SKU-1</div><div class=price>$2.00</div>";
        let (key, fields) = extract(&page, html, BodyFormat::Html, &links, None, Some(&record))
            .record
            .unwrap()
            .unwrap();
        assert_eq!(key, "SKU-1");
        assert_eq!(fields.get_str("title").unwrap(), "Mug deluxe");
        assert_eq!(fields.get_str("price").unwrap(), "$2.00");
        let missing = extract(
            &page,
            "<h1>Mug</h1>",
            BodyFormat::Html,
            &links,
            None,
            Some(&record),
        )
        .record
        .unwrap();
        assert_eq!(missing.unwrap_err(), "no natural key (.sku) on the page");
    }

    #[test]
    fn a_detail_page_names_its_canonical_url_when_it_is_another_followable_one() {
        let (links, _, record) = rules();
        let read = |url: &str, head: &str| {
            let page = Url::parse(url).unwrap();
            let html = format!("<head>{head}</head><div class=sku>S</div>");
            extract(&page, &html, BodyFormat::Html, &links, None, Some(&record)).canonical
        };
        let canonical = read(
            "http://shop.test:8080/product/S/red",
            r#"<link rel="Canonical" href="/product/S">"#,
        );
        assert_eq!(
            canonical.unwrap().as_str(),
            "http://shop.test:8080/product/S"
        );
        let own = read(
            "http://shop.test:8080/product/S",
            r#"<link rel="canonical" href="/product/S?utm_source=x">"#,
        );
        assert!(own.is_none(), "the page's own URL, once normalized");
        let elsewhere = read(
            "http://shop.test:8080/product/S/red",
            r#"<link rel="canonical" href="http://elsewhere.test/product/S">"#,
        );
        assert!(elsewhere.is_none(), "out of scope: the page keeps its URL");
    }

    #[test]
    fn hostile_markup_does_not_break_extraction() {
        let (links, list, record) = rules();
        let page = Url::parse("http://shop.test:8080/product/x").unwrap();
        let nasty = format!("<div class=item data-id='{}'>{}<a href='javascript:alert(1)'>x</a><a href='//shop.test:8080/ok'>", "a".repeat(10_000), "<div>".repeat(5_000));
        let data = extract(
            &page,
            &nasty,
            BodyFormat::Html,
            &links,
            Some(&list),
            Some(&record),
        );
        assert_eq!(
            data.links.iter().map(|u| u.as_str()).collect::<Vec<_>>(),
            ["http://shop.test:8080/ok"]
        );
        assert!(data.record.unwrap().is_err());
        let lossy = String::from_utf8_lossy(b"<div class=sku>SKU-\xff</div>");
        let data = extract(&page, &lossy, BodyFormat::Html, &links, None, Some(&record));
        assert_eq!(data.record.unwrap().unwrap().0, "SKU-\u{fffd}");
    }

    #[test]
    fn value_specs_parse_selectors_and_attributes() {
        assert!(ValueSpec::parse("a@href").is_ok());
        assert!(ValueSpec::parse("@data-id").is_ok());
        assert!(ValueSpec::parse(".price").is_ok());
        assert!(
            ValueSpec::parse("a[href^='mailto:x@y']").is_ok(),
            "an @ inside a selector is not an attribute"
        );
        assert!(ValueSpec::parse("").is_err());
        assert!(ValueSpec::parse("div[")
            .unwrap_err()
            .contains("not a CSS selector"));
    }

    #[test]
    fn a_page_with_a_million_links_yields_at_most_max_links() {
        let (mut links, list, _) = rules();
        links.max = 1_000;
        let url = Url::parse("http://shop.test:8080/list/1").unwrap();
        let mut page = String::with_capacity(20_000_000);
        page.push_str("<html><body>");
        for i in 0..1_000_000 {
            page.push_str(&format!("<a href=/p/{i}>{i}</a>"));
        }
        page.push_str("</body></html>");
        let data = extract(&url, &page, BodyFormat::Html, &links, Some(&list), None);
        assert_eq!(data.links.len(), 1_000);
        assert_eq!(data.links[999].as_str(), "http://shop.test:8080/p/999");
        assert_eq!(data.dropped, 1_000_000 - 1_000);
        // Listing items are capped alike.
        let items: String = (0..3_000)
            .map(|i| format!("<div class=item data-id={i}><a href=/p/{i}>{i}</a></div>"))
            .collect();
        let data = extract(&url, &items, BodyFormat::Html, &links, Some(&list), None);
        assert_eq!((data.items.len(), data.links.len()), (1_000, 1_000));
        assert_eq!(data.dropped, 2 * 2_000);
    }
}
