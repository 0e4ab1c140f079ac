//! Refreshing a bot's seeds: fetch the seed source over HTTP (timeout, body cap, retries with
//! jittered backoff, cancellation), parse it (lines, JSON array, sitemap and sitemap index with a
//! depth bound), normalize, dedupe, keep only http(s) URLs and cap the count.

use std::collections::HashSet;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use url::Url;

use crate::backoff::full_jitter;
use crate::config::{RefreshLimits, SeedFormat, SeedSource};
use crate::urls::NormalizedUrl;

#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    #[error("{url}: HTTP {status}")]
    Status {
        url: String,
        status: u16,
        transient: bool,
    },
    #[error("{url}: {detail}")]
    Transport {
        url: String,
        detail: String,
        transient: bool,
    },
    #[error("{url}: body larger than {max} bytes")]
    TooLarge { url: String, max: usize },
    #[error("{url}: {detail}")]
    Parse { url: String, detail: String },
    #[error("the seed source yielded no usable URL{}", rejected_note(*.rejected))]
    Empty { rejected: usize },
    #[error("cancelled")]
    Cancelled,
}

fn rejected_note(rejected: usize) -> String {
    if rejected == 0 {
        String::new()
    } else {
        format!(" ({rejected} entries rejected)")
    }
}

impl SeedError {
    fn is_transient(&self) -> bool {
        match self {
            SeedError::Status { transient, .. } | SeedError::Transport { transient, .. } => {
                *transient
            }
            _ => false,
        }
    }
}

/// The result of one refresh: normalized, deduplicated seeds, and how many entries were dropped.
#[derive(Debug, PartialEq)]
pub struct Seeds {
    pub urls: Vec<NormalizedUrl>,
    pub rejected: usize,
    pub truncated: bool,
}

#[derive(Clone, Debug)]
pub struct SeedReader {
    http: reqwest::Client,
    limits: RefreshLimits,
}

impl SeedReader {
    pub fn new(limits: RefreshLimits) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .user_agent(limits.user_agent.clone())
            .timeout(limits.timeout)
            .connect_timeout(limits.timeout.min(Duration::from_secs(10)))
            .redirect(reqwest::redirect::Policy::limited(5))
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        Ok(Self { http, limits })
    }

    /// Fetches and parses the whole source. Returns `Cancelled` promptly when `cancel` fires.
    pub async fn fetch(
        &self,
        source: &SeedSource,
        cancel: &CancellationToken,
    ) -> Result<Seeds, SeedError> {
        let mut collector = Collector::new(self.limits.max_seeds);
        match source {
            SeedSource::Static(urls) => {
                for url in urls {
                    collector.add(Ok(url.clone()));
                }
            }
            SeedSource::Url { url, format } => {
                let body = self.get_with_retries(url.as_str(), cancel).await?;
                match format {
                    SeedFormat::Lines => parse_lines(&body, &mut collector),
                    SeedFormat::Json => parse_json(url.as_str(), &body, &mut collector)?,
                    SeedFormat::Sitemap => {
                        self.walk_sitemap(url.to_url(), body, &mut collector, cancel)
                            .await?
                    }
                }
            }
        }
        collector.finish()
    }

    async fn walk_sitemap(
        &self,
        root: Url,
        body: String,
        collector: &mut Collector,
        cancel: &CancellationToken,
    ) -> Result<(), SeedError> {
        // Breadth-first over sitemap indexes, at most `sitemap_depth` levels below the root and at
        // most 1,000 sitemap files in all; each file is fetched once, and only one body is held in
        // memory at a time (the queue holds URLs).
        const MAX_FILES: usize = 1000;
        let mut visited = HashSet::from([root.to_string()]);
        let mut queue = std::collections::VecDeque::from([(root, 0_u32, Some(body))]);
        while let Some((url, depth, body)) = queue.pop_front() {
            let body = match body {
                Some(body) => body,
                None => self.get_with_retries(url.as_str(), cancel).await?,
            };
            match parse_sitemap(url.as_str(), &body)? {
                Sitemap::Urls(locs) => {
                    for loc in locs {
                        collector.add(NormalizedUrl::parse_relative(&url, &loc));
                    }
                }
                Sitemap::Index(children) => {
                    if depth == self.limits.sitemap_depth {
                        return Err(SeedError::Parse {
                            url: url.to_string(),
                            detail: format!(
                                "sitemap indexes nest deeper than {}",
                                self.limits.sitemap_depth
                            ),
                        });
                    }
                    for child in children {
                        let child =
                            NormalizedUrl::parse_relative(&url, &child).map_err(|detail| {
                                SeedError::Parse {
                                    url: url.to_string(),
                                    detail,
                                }
                            })?;
                        if visited.len() >= MAX_FILES {
                            return Err(SeedError::Parse {
                                url: url.to_string(),
                                detail: format!("more than {MAX_FILES} sitemap files"),
                            });
                        }
                        if visited.insert(child.as_str().to_owned()) {
                            queue.push_back((child.to_url(), depth + 1, None));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    async fn get_with_retries(
        &self,
        url: &str,
        cancel: &CancellationToken,
    ) -> Result<String, SeedError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let result = tokio::select! {
                _ = cancel.cancelled() => return Err(SeedError::Cancelled),
                r = self.get_once(url) => r,
            };
            match result {
                Err(e) if e.is_transient() && attempt < self.limits.attempts => {
                    let delay = full_jitter(
                        self.limits.backoff_base,
                        self.limits.backoff_max,
                        attempt - 1,
                    );
                    tracing::debug!(%url, attempt, error = %e, ?delay, "seed source failed; retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => return Err(SeedError::Cancelled),
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
                other => return other,
            }
        }
    }

    async fn get_once(&self, url: &str) -> Result<String, SeedError> {
        let transport = |e: reqwest::Error| SeedError::Transport {
            url: url.to_owned(),
            detail: describe_reqwest(&e),
            transient: e.is_timeout() || e.is_connect() || e.is_request() || e.is_body(),
        };
        let mut response = self.http.get(url).send().await.map_err(transport)?;
        let status = response.status();
        if !status.is_success() {
            return Err(SeedError::Status {
                url: url.to_owned(),
                status: status.as_u16(),
                transient: status.is_server_error()
                    || status.as_u16() == 429
                    || status.as_u16() == 408,
            });
        }
        let max = self.limits.max_bytes;
        if response
            .content_length()
            .is_some_and(|len| len > max as u64)
        {
            return Err(SeedError::TooLarge {
                url: url.to_owned(),
                max,
            });
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(transport)? {
            if body.len() + chunk.len() > max {
                return Err(SeedError::TooLarge {
                    url: url.to_owned(),
                    max,
                });
            }
            body.extend_from_slice(&chunk);
        }
        Ok(String::from_utf8_lossy(&body).into_owned())
    }
}

/// A request error with its causes, in one line.
pub(crate) fn describe_reqwest(e: &reqwest::Error) -> String {
    use std::error::Error as _;
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Normalizes, dedupes and caps as URLs come in.
struct Collector {
    seen: HashSet<NormalizedUrl>,
    urls: Vec<NormalizedUrl>,
    rejected: usize,
    truncated: bool,
    max: usize,
}

impl Collector {
    fn new(max: usize) -> Self {
        Self {
            seen: HashSet::new(),
            urls: Vec::new(),
            rejected: 0,
            truncated: false,
            max,
        }
    }

    fn add(&mut self, url: Result<NormalizedUrl, String>) {
        match url {
            Ok(url) if self.seen.contains(&url) => {}
            Ok(_) if self.urls.len() >= self.max => self.truncated = true,
            Ok(url) => {
                self.seen.insert(url.clone());
                self.urls.push(url);
            }
            Err(why) => {
                self.rejected += 1;
                if self.rejected <= 5 {
                    tracing::debug!(%why, "seed entry rejected");
                }
            }
        }
    }

    fn finish(self) -> Result<Seeds, SeedError> {
        if self.urls.is_empty() {
            return Err(SeedError::Empty {
                rejected: self.rejected,
            });
        }
        Ok(Seeds {
            urls: self.urls,
            rejected: self.rejected,
            truncated: self.truncated,
        })
    }
}

/// One URL per line; blank lines and `#` comments are skipped.
fn parse_lines(body: &str, collector: &mut Collector) {
    for line in body.lines().map(str::trim) {
        if !line.is_empty() && !line.starts_with('#') {
            collector.add(NormalizedUrl::parse(line));
        }
    }
}

/// A JSON array of strings.
fn parse_json(url: &str, body: &str, collector: &mut Collector) -> Result<(), SeedError> {
    let value: serde_json::Value = serde_json::from_str(body).map_err(|e| SeedError::Parse {
        url: url.to_owned(),
        detail: format!("not JSON: {e}"),
    })?;
    let serde_json::Value::Array(items) = value else {
        return Err(SeedError::Parse {
            url: url.to_owned(),
            detail: "expected a JSON array of URLs".into(),
        });
    };
    for item in items {
        match item {
            serde_json::Value::String(s) => collector.add(NormalizedUrl::parse(&s)),
            other => collector.add(Err(format!("{other} is not a string"))),
        }
    }
    Ok(())
}

#[derive(Debug, PartialEq)]
enum Sitemap {
    Urls(Vec<String>),
    Index(Vec<String>),
}

/// `<urlset><url><loc>` or `<sitemapindex><sitemap><loc>` (sitemaps.org), namespace-agnostic.
fn parse_sitemap(url: &str, body: &str) -> Result<Sitemap, SeedError> {
    let parse_error = |detail: String| SeedError::Parse {
        url: url.to_owned(),
        detail,
    };
    let options = roxmltree::ParsingOptions {
        allow_dtd: false,
        nodes_limit: 5_000_000,
    };
    let xml = roxmltree::Document::parse_with_options(body, options)
        .map_err(|e| parse_error(format!("not a sitemap: {e}")))?;
    let root = xml.root_element();
    let (entry, index) = match root.tag_name().name() {
        "urlset" => ("url", false),
        "sitemapindex" => ("sitemap", true),
        other => {
            return Err(parse_error(format!(
                "root element <{other}> is neither <urlset> nor <sitemapindex>"
            )))
        }
    };
    let locs = root
        .children()
        .filter(|n| n.has_tag_name(entry))
        .filter_map(|n| n.children().find(|c| c.has_tag_name("loc")))
        .filter_map(|loc| loc.text().map(|t| t.trim().to_owned()))
        .filter(|t| !t.is_empty())
        .collect();
    Ok(if index {
        Sitemap::Index(locs)
    } else {
        Sitemap::Urls(locs)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(f: impl FnOnce(&mut Collector)) -> Result<Seeds, SeedError> {
        let mut c = Collector::new(3);
        f(&mut c);
        c.finish()
    }

    #[test]
    fn lines_skip_comments_dedupe_and_reject_non_http() {
        let body = "# seeds\nhttp://a.example/x\n\n HTTP://A.EXAMPLE/x#frag \nftp://b/\nnot a url\nhttps://c.example/";
        let seeds = collect(|c| parse_lines(body, c)).unwrap();
        let urls: Vec<_> = seeds.urls.iter().map(|u| u.as_str()).collect();
        assert_eq!(urls, ["http://a.example/x", "https://c.example/"]);
        assert_eq!(seeds.rejected, 2);
    }

    #[test]
    fn the_count_is_capped() {
        let body = "http://h/1\nhttp://h/2\nhttp://h/3\nhttp://h/4";
        let seeds = collect(|c| parse_lines(body, c)).unwrap();
        assert_eq!(seeds.urls.len(), 3);
        assert!(seeds.truncated);
    }

    #[test]
    fn json_must_be_an_array_of_strings() {
        let seeds =
            collect(|c| parse_json("u", r#"["http://h/1", 5, "http://h/1"]"#, c).unwrap()).unwrap();
        assert_eq!((seeds.urls.len(), seeds.rejected), (1, 1));
        let mut c = Collector::new(3);
        assert!(matches!(
            parse_json("u", r#"{"a":1}"#, &mut c),
            Err(SeedError::Parse { .. })
        ));
        assert!(matches!(
            parse_json("u", "[", &mut c),
            Err(SeedError::Parse { .. })
        ));
    }

    #[test]
    fn nothing_usable_is_an_error_not_an_empty_list() {
        assert!(matches!(
            collect(|c| parse_lines("# only comments\nftp://x/", c)),
            Err(SeedError::Empty { rejected: 1 })
        ));
    }

    #[test]
    fn sitemaps_and_indexes_are_told_apart() {
        let urlset = r#"<?xml version="1.0"?><urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">
            <url><loc> http://h/a </loc></url><url><loc>http://h/b</loc></url></urlset>"#;
        assert_eq!(
            parse_sitemap("u", urlset).unwrap(),
            Sitemap::Urls(vec!["http://h/a".into(), "http://h/b".into()])
        );
        let index = r#"<sitemapindex xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">
            <sitemap><loc>http://h/s1.xml</loc></sitemap></sitemapindex>"#;
        assert_eq!(
            parse_sitemap("u", index).unwrap(),
            Sitemap::Index(vec!["http://h/s1.xml".into()])
        );
        assert!(parse_sitemap("u", "<html></html>").is_err());
        assert!(parse_sitemap("u", "<urlset>").is_err());
        let dtd = r#"<!DOCTYPE x [<!ENTITY a "aaaa">]><urlset><url><loc>&a;</loc></url></urlset>"#;
        assert!(
            parse_sitemap("u", dtd).is_err(),
            "DTDs (entity expansion) are refused"
        );
    }
}
