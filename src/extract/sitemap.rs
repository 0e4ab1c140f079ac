//! Sitemaps (sitemaps.org) read as a stream: a `<urlset>` lists pages (each `<url>` a `<loc>` and
//! an optional `<lastmod>`), a `<sitemapindex>` lists further sitemap files. The reader pulls the
//! decoded bytes through `quick-xml` a buffer at a time, so a file of 50,000 URLs is never held
//! whole, and keeps only each entry's two strings. A file has the protocol's limits, not a page's:
//! at most [`MAX_URLS`] entries (the rest are counted, not kept) and [`MAX_DECODED_BYTES`] decoded
//! (past them the file fails as too large). A DTD is refused: no entity expansion.

use quick_xml::events::Event;
use url::Url;

use super::{parse_time, LinkRules, ListItem, PageData, RecordRules};
use crate::urls::NormalizedUrl;

/// Entries one sitemap file lists at most (the protocol's limit).
pub const MAX_URLS: usize = 50_000;

/// Decoded bytes one sitemap file holds at most (the protocol's 50 MiB).
pub const MAX_DECODED_BYTES: u64 = 50 * 1024 * 1024;

/// One sitemap file, read: its entries packed into one text (a file of 50,000 URLs is one
/// allocation of a few MB, not 100,000 small ones that outlive it as a fragmented heap).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sitemap {
    /// A `<sitemapindex>`: the entries are sitemap files, not pages.
    pub index: bool,
    /// Every entry's `<loc>` then its `<lastmod>`, back to back.
    text: String,
    /// Per entry, where its `<loc>` ends in `text` and where its `<lastmod>` ends (the same
    /// place: none).
    ends: Vec<(u32, u32)>,
    /// Entries past [`MAX_URLS`], not kept.
    pub dropped: usize,
    /// The file's decoded size.
    pub bytes: u64,
}

impl Sitemap {
    /// About what the file holds in memory once read (for the crawl's byte budget).
    pub fn weight(&self) -> usize {
        self.text.len() + 8 * self.ends.len()
    }

    /// How many entries it lists.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Its entries in file order: each `<loc>` and its `<lastmod>`, if any — a page (in a
    /// `<urlset>`) or a sitemap file (in an index).
    pub fn entries(&self) -> impl Iterator<Item = (&str, Option<&str>)> + '_ {
        let mut start = 0;
        self.ends.iter().map(move |&(loc, lastmod)| {
            let (loc, lastmod) = (loc as usize, lastmod as usize);
            let entry = (
                &self.text[start..loc],
                (lastmod > loc).then(|| &self.text[loc..lastmod]),
            );
            start = lastmod;
            entry
        })
    }

    /// Adds an entry (at most [`MAX_DECODED_BYTES`] of text, so its offsets fit).
    fn push(&mut self, loc: &str, lastmod: Option<&str>) {
        self.text.push_str(loc);
        let loc_end = self.text.len() as u32;
        self.text.push_str(lastmod.unwrap_or_default());
        self.ends.push((loc_end, self.text.len() as u32));
    }
}

/// Why a file is not read as a sitemap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SitemapError {
    /// Well-formed XML of another kind (an RSS feed, say): not a sitemap, nothing to read.
    NotASitemap(String),
    /// Over [`MAX_DECODED_BYTES`].
    TooLarge,
    /// Broken XML, a DTD, or an I/O error while the body was read.
    Broken(String),
}

impl std::fmt::Display for SitemapError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SitemapError::NotASitemap(root) => {
                write!(f, "XML, but not a sitemap (root element <{root}>)")
            }
            SitemapError::TooLarge => write!(
                f,
                "sitemap larger than {MAX_DECODED_BYTES} bytes decoded (the protocol's limit)"
            ),
            SitemapError::Broken(why) => write!(f, "broken sitemap: {why}"),
        }
    }
}

/// A reader that fails past `limit` bytes: the decoded-size cap, however the bytes arrived.
struct Capped<R> {
    inner: R,
    read: u64,
    limit: u64,
}

impl<R: std::io::Read> std::io::Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        if self.read > self.limit {
            return Err(std::io::Error::other(TOO_LARGE));
        }
        Ok(n)
    }
}

const TOO_LARGE: &str = "the sitemap's decoded size is over the limit";

/// Reads a sitemap file from `body` (decoded bytes; gzip is the caller's): its entries in file
/// order, each `<loc>` trimmed, empty ones left out.
pub fn read(body: impl std::io::Read) -> Result<Sitemap, SitemapError> {
    read_capped(body, MAX_DECODED_BYTES, MAX_URLS)
}

fn read_capped(
    body: impl std::io::Read,
    limit: u64,
    max_urls: usize,
) -> Result<Sitemap, SitemapError> {
    let capped = Capped {
        inner: body,
        read: 0,
        limit,
    };
    let mut reader =
        quick_xml::Reader::from_reader(std::io::BufReader::with_capacity(64 * 1024, capped));
    reader.config_mut().expand_empty_elements = true;
    let mut sitemap = Sitemap::default();
    let mut buf = Vec::new();
    // Where the reader is: 0 outside the root, 1 in it, 2 in an entry, 3 in a field of one.
    let mut depth = 0usize;
    let mut root_seen = false;
    let mut field: Option<Field> = None;
    let mut text = String::new();
    let (mut loc, mut lastmod) = (String::new(), String::new());
    let broken = |e: quick_xml::Error| match e {
        quick_xml::Error::Io(io) if io.to_string() == TOO_LARGE => SitemapError::TooLarge,
        e => SitemapError::Broken(e.to_string()),
    };
    loop {
        let event = reader.read_event_into(&mut buf).map_err(broken)?;
        match event {
            Event::Start(e) => {
                depth += 1;
                let name = e.local_name();
                let name = name.as_ref();
                match depth {
                    1 if root_seen => {
                        return Err(SitemapError::Broken("more than one root element".into()))
                    }
                    1 => {
                        root_seen = true;
                        sitemap.index = match name {
                            b"urlset" => false,
                            b"sitemapindex" => true,
                            other => {
                                return Err(SitemapError::NotASitemap(
                                    String::from_utf8_lossy(other).into_owned(),
                                ))
                            }
                        }
                    }
                    3 => {
                        field = match name {
                            b"loc" => Some(Field::Loc),
                            b"lastmod" => Some(Field::Lastmod),
                            _ => None,
                        };
                        text.clear();
                    }
                    _ => {}
                }
            }
            Event::End(_) => {
                match depth {
                    3 => {
                        let value = text.trim();
                        match field.take() {
                            Some(Field::Loc) => value.clone_into(&mut loc),
                            Some(Field::Lastmod) => value.clone_into(&mut lastmod),
                            _ => {}
                        }
                    }
                    2 => {
                        if !loc.is_empty() {
                            if sitemap.len() < max_urls {
                                sitemap
                                    .push(&loc, Some(lastmod.as_str()).filter(|m| !m.is_empty()));
                            } else {
                                sitemap.dropped += 1;
                            }
                        }
                        loc.clear();
                        lastmod.clear();
                    }
                    _ => {}
                }
                depth = depth.saturating_sub(1);
            }
            Event::Text(t) if field.is_some() => {
                let part = t
                    .decode()
                    .map_err(|e| SitemapError::Broken(e.to_string()))?;
                text.push_str(&part);
            }
            Event::CData(t) if field.is_some() => {
                let part = t
                    .decode()
                    .map_err(|e| SitemapError::Broken(e.to_string()))?;
                text.push_str(&part);
            }
            Event::GeneralRef(r) if field.is_some() => {
                if let Some(c) = r.resolve_char_ref().map_err(broken)? {
                    text.push(c);
                } else {
                    let name = r
                        .decode()
                        .map_err(|e| SitemapError::Broken(e.to_string()))?;
                    match quick_xml::escape::resolve_predefined_entity(&name) {
                        Some(s) => text.push_str(s),
                        None => {
                            return Err(SitemapError::Broken(format!("unknown entity &{name};")))
                        }
                    }
                }
            }
            Event::DocType(_) => {
                return Err(SitemapError::Broken(
                    "a DTD (refused: no entity expansion)".into(),
                ))
            }
            Event::Eof => break,
            _ => {}
        }
        buf.clear();
    }
    if !root_seen {
        return Err(SitemapError::Broken("no root element".into()));
    }
    if depth != 0 {
        return Err(SitemapError::Broken(
            "the file ends inside an element".into(),
        ));
    }
    sitemap.bytes = reader.get_ref().get_ref().read;
    sitemap.text.shrink_to_fit();
    sitemap.ends.shrink_to_fit();
    Ok(sitemap)
}

#[derive(Clone, Copy)]
enum Field {
    Loc,
    Lastmod,
}

/// A sitemap file as the crawl reads a listing page: an index's files are its links (followed
/// like a listing's next page), a `<urlset>`'s pages are its items — each one's link the
/// normalized `<loc>`, its fingerprint the `<lastmod>` (without one, the item carries no change
/// signal and is fetched every pass), its change time the `<lastmod>` read as a time. A page
/// the bot's `record.match` does not match (a sitemap of category pages) is a link, followed
/// as a listing page. Entries the link rules refuse (scope, `allow`, `deny`) are left out;
/// entries past the file's limit are counted as dropped.
pub(crate) fn page_data(
    page_url: &Url,
    sitemap: Sitemap,
    links: &LinkRules,
    record: Option<&RecordRules>,
) -> PageData {
    let mut data = PageData {
        dropped: sitemap.dropped,
        ..PageData::default()
    };
    if !sitemap.index {
        data.items.reserve_exact(sitemap.len());
    }
    // Each URL once, told by a 64-bit hash of its text (a copy of every URL would weigh as much
    // as the items); two URLs that share a hash are compared in full.
    let mut seen = std::collections::HashSet::with_capacity(sitemap.len());
    let hash = |url: &NormalizedUrl| {
        use std::hash::{BuildHasher, BuildHasherDefault};
        BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default()
            .hash_one(url.as_str())
    };
    for (loc, lastmod) in sitemap.entries() {
        let Some(url) = NormalizedUrl::join_with(page_url, loc, &links.strip)
            .ok()
            .filter(|u| links.admits_counting(u, &mut data.bounded))
        else {
            continue;
        };
        if !seen.insert(hash(&url)) {
            let again = data.links.contains(&url)
                || data.items.iter().any(|i| i.url.as_ref() == Some(&url));
            if again {
                continue;
            }
        }
        let detail = record.is_none_or(|r| r.url_match.is_match(url.as_str()));
        if sitemap.index || !detail {
            data.links.push(url);
        } else {
            data.items.push(ListItem {
                id: String::new(),
                url: Some(url),
                unversioned: lastmod.is_none(),
                fingerprint: lastmod.unwrap_or_default().to_owned(),
                updated_at: lastmod.and_then(parse_lastmod),
            });
        }
    }
    data
}

/// A `<lastmod>`: W3C datetime — RFC 3339, or a date alone (midnight UTC).
fn parse_lastmod(raw: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    parse_time(raw).or_else(|| {
        chrono::NaiveDate::parse_from_str(raw.trim(), "%Y-%m-%d")
            .ok()
            .and_then(|d| d.and_hms_opt(0, 0, 0))
            .map(|t| t.and_utc())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Link rules in the scope `shop`, refusing the URLs `deny` matches.
    fn shop_links(deny: &[&str]) -> LinkRules {
        LinkRules {
            scope: vec!["shop".into()],
            follow: None,
            follow_json: Vec::new(),
            allow: Vec::new(),
            deny: deny.iter().map(|d| regex::Regex::new(d).unwrap()).collect(),
            strip: crate::urls::StripQuery::default(),
            max: 10,
            max_url_length: 2048,
        }
    }

    const URLSET: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">
  <url><loc> http://shop/product/A?x=1&amp;y=2 </loc><lastmod>2026-01-02</lastmod></url>
  <url><loc><![CDATA[http://shop/product/B]]></loc></url>
  <url><loc></loc></url>
  <url><priority>0.5</priority><loc>http://shop/product/&#67;</loc><lastmod>2026-01-03T04:05:06Z</lastmod></url>
</urlset>"#;

    fn entry<'a>(loc: &'a str, lastmod: Option<&'a str>) -> (&'a str, Option<&'a str>) {
        (loc, lastmod)
    }

    #[test]
    fn a_urlset_lists_locs_with_their_lastmods_unescaped() {
        let read = read(URLSET.as_bytes()).unwrap();
        assert!(!read.index);
        assert_eq!(
            read.entries().collect::<Vec<_>>(),
            [
                entry("http://shop/product/A?x=1&y=2", Some("2026-01-02")),
                entry("http://shop/product/B", None),
                entry("http://shop/product/C", Some("2026-01-03T04:05:06Z")),
            ]
        );
        assert_eq!(read.bytes, URLSET.len() as u64);
    }

    #[test]
    fn a_page_listed_twice_is_one_item() {
        let twice = r#"<urlset><url><loc>http://shop/p/1</loc><lastmod>2026-01-01</lastmod></url>
            <url><loc>http://shop/p/2</loc></url><url><loc>http://shop/p/1</loc></url></urlset>"#;
        let rules = shop_links(&[]);
        let page = Url::parse("http://shop/sitemap.xml").unwrap();
        let data = page_data(&page, read(twice.as_bytes()).unwrap(), &rules, None);
        let urls: Vec<_> = data
            .items
            .iter()
            .map(|i| i.url.as_ref().unwrap().as_str())
            .collect();
        assert_eq!(urls, ["http://shop/p/1", "http://shop/p/2"]);
        assert_eq!(
            data.items[0].fingerprint, "2026-01-01",
            "the first listing of it counts"
        );
    }

    #[test]
    fn an_index_lists_sitemap_files_and_other_xml_is_not_a_sitemap() {
        let index = r#"<sm:sitemapindex xmlns:sm="http://www.sitemaps.org/schemas/sitemap/0.9">
            <sm:sitemap><sm:loc>http://shop/s1.xml.gz</sm:loc></sm:sitemap></sm:sitemapindex>"#;
        let read = read(index.as_bytes()).unwrap();
        assert!(read.index);
        assert_eq!(
            read.entries().collect::<Vec<_>>(),
            [entry("http://shop/s1.xml.gz", None)]
        );
        assert_eq!(
            super::read("<rss><channel/></rss>".as_bytes()),
            Err(SitemapError::NotASitemap("rss".into()))
        );
    }

    #[test]
    fn broken_files_and_dtds_are_errors_not_panics() {
        for body in [
            "",
            "<urlset><url><loc>http://a/</loc></url>",
            "<urlset><url><loc>http://a/</url></urlset>",
            "<urlset></urlset><urlset></urlset>",
            "<!DOCTYPE urlset [<!ENTITY x \"y\">]><urlset/>",
            "<urlset><url><loc>&bogus;</loc></url></urlset>",
        ] {
            assert!(
                matches!(read(body.as_bytes()), Err(SitemapError::Broken(_))),
                "{body:?}"
            );
        }
    }

    #[test]
    fn the_entry_limit_drops_and_counts_and_the_size_limit_fails() {
        let read = read_capped(URLSET.as_bytes(), MAX_DECODED_BYTES, 2).unwrap();
        assert_eq!((read.len(), read.dropped), (2, 1));
        assert_eq!(
            read_capped(URLSET.as_bytes(), 100, MAX_URLS),
            Err(SitemapError::TooLarge)
        );
    }

    #[test]
    fn a_files_pages_become_items_fingerprinted_by_lastmod() {
        let rules = shop_links(&["/C$"]);
        let page = Url::parse("http://shop/sitemap.xml").unwrap();
        let data = page_data(&page, read(URLSET.as_bytes()).unwrap(), &rules, None);
        let got: Vec<_> = data
            .items
            .iter()
            .map(|i| {
                (
                    i.url.as_ref().unwrap().as_str().to_owned(),
                    i.fingerprint.clone(),
                    i.unversioned,
                    i.updated_at.map(|t| t.to_rfc3339()),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    "http://shop/product/A?x=1&y=2".to_owned(),
                    "2026-01-02".to_owned(),
                    false,
                    Some("2026-01-02T00:00:00+00:00".to_owned())
                ),
                (
                    "http://shop/product/B".to_owned(),
                    String::new(),
                    true,
                    None
                ),
            ]
        );
        assert!(data.links.is_empty());
    }
}
