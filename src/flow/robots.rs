//! robots.txt, fetched once per host (`scheme://host:port`) and cached for `robots_ttl`, parsed
//! by `texting_robots` for each user agent's product token (the instance's, or a bot's own
//! `user_agent`: one file, a verdict per agent): `Disallow`/`Allow` decide which URLs
//! may be fetched, `Crawl-delay` spaces the host's requests (through [`crate::flow`]). A 4xx
//! means no rules (everything allowed); a 5xx or no answer means "not now": the caller pauses the
//! host and asks again after `robots_retry`. `--ignore-robots` (for one's own sites) turns the
//! whole check off.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use texting_robots::Robot;
use tokio::time::Instant;

use crate::http_client::{HttpClient, RobotsFetch};
use crate::urls::NormalizedUrl;

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Verdict {
    Allowed {
        crawl_delay: Option<Duration>,
    },
    Disallowed,
    /// robots.txt could not be read (a 5xx, no answer): pause the host, ask again later.
    Unavailable {
        reason: String,
    },
}

#[derive(Clone)]
struct Rules {
    /// `None`: no robots.txt (a 4xx), everything allowed.
    body: Option<Arc<Vec<u8>>>,
    /// The file parsed for each agent asked for (`None`: unparsable, no rules).
    parsed: Arc<Mutex<HashMap<String, Option<Arc<Robot>>>>>,
    fetched: Instant,
}

impl Rules {
    /// The rules for `agent`, parsed on first use.
    fn robot(&self, agent: &str, origin: &str) -> Option<Arc<Robot>> {
        let body = self.body.as_ref()?;
        let mut parsed = self.parsed.lock().unwrap_or_else(|p| p.into_inner());
        parsed
            .entry(agent.to_owned())
            .or_insert_with(|| match Robot::new(agent, body) {
                Ok(robot) => Some(Arc::new(robot)),
                // Unparsable rules are no rules (as a 4xx), not a reason to stop crawling.
                Err(e) => {
                    tracing::warn!(%origin, error = %e, "robots.txt unparsable; treating it as empty");
                    None
                }
            })
            .clone()
    }
}

/// One origin's rules: read without waiting (every fetch asks), fetched by one task at a time.
#[derive(Default)]
struct Origin {
    rules: std::sync::RwLock<Option<Rules>>,
    fetching: tokio::sync::Mutex<()>,
}

type Slot = Arc<Origin>;

pub struct RobotsCache {
    agent: String,
    ttl: Duration,
    enabled: bool,
    hosts: Mutex<HashMap<String, Slot>>,
}

impl std::fmt::Debug for RobotsCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RobotsCache")
            .field("agent", &self.agent)
            .field("enabled", &self.enabled)
            .finish_non_exhaustive()
    }
}

/// The product token of a user agent (`seedlock/0.1 (+https://…)` → `seedlock`): what
/// robots.txt `User-agent` lines name.
pub(crate) fn product_token(user_agent: &str) -> &str {
    user_agent
        .split(|c: char| c == '/' || c.is_whitespace())
        .next()
        .filter(|t| !t.is_empty())
        .unwrap_or("*")
}

impl RobotsCache {
    pub(crate) fn new(user_agent: &str, ttl: Duration, enabled: bool) -> Self {
        Self {
            agent: product_token(user_agent).to_owned(),
            ttl,
            enabled,
            hosts: Mutex::new(HashMap::new()),
        }
    }

    /// Whether the rules for `url`'s host are read (or not needed): until they are, the
    /// dispatcher admits one request to the host at a time, so a `Crawl-delay` applies from the
    /// first requests on, not after a burst.
    pub(crate) fn known(&self, url: &NormalizedUrl) -> bool {
        if !self.enabled {
            return true;
        }
        let slot = self
            .hosts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&url.origin())
            .cloned();
        slot.is_some_and(|slot| {
            slot.rules
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .is_some()
        })
    }

    /// The verdict for `url` from `rules` for `agent`, if they are fresh.
    fn verdict(&self, rules: &Option<Rules>, agent: &str, url: &NormalizedUrl) -> Option<Verdict> {
        let rules = rules.as_ref().filter(|r| r.fetched.elapsed() < self.ttl)?;
        Some(match rules.robot(agent, &url.origin()).as_ref() {
            None => Verdict::Allowed { crawl_delay: None },
            Some(robot) if robot.allowed(url.as_str()) => Verdict::Allowed {
                crawl_delay: robot
                    .delay
                    .filter(|d| d.is_finite() && *d > 0.0)
                    .map(|d| Duration::from_secs_f32(d.min(60.0))),
            },
            Some(_) => Verdict::Disallowed,
        })
    }

    /// Whether `url` may be fetched by `fetcher`'s user agent (a bot's own, or the instance's),
    /// reading the host's robots.txt first if it is not cached. Concurrent checks on one host
    /// wait for a single fetch.
    pub(crate) async fn check(&self, fetcher: &HttpClient, url: &NormalizedUrl) -> Verdict {
        if !self.enabled {
            return Verdict::Allowed { crawl_delay: None };
        }
        let agent = fetcher
            .own_user_agent()
            .map_or(self.agent.as_str(), product_token);
        let origin = url.origin();
        let slot = self
            .hosts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(origin.clone())
            .or_default()
            .clone();
        let fresh = |slot: &Origin| {
            self.verdict(
                &slot.rules.read().unwrap_or_else(|p| p.into_inner()),
                agent,
                url,
            )
        };
        if let Some(verdict) = fresh(&slot) {
            return verdict;
        }
        let _fetching = slot.fetching.lock().await;
        // Another task may have read it meanwhile.
        if let Some(verdict) = fresh(&slot) {
            return verdict;
        }
        let rules = match Self::fetch(fetcher, &origin).await {
            Ok(rules) => Some(rules),
            Err(reason) => return Verdict::Unavailable { reason },
        };
        let verdict = self
            .verdict(&rules, agent, url)
            .unwrap_or(Verdict::Allowed { crawl_delay: None });
        *slot.rules.write().unwrap_or_else(|p| p.into_inner()) = rules;
        verdict
    }

    /// `origin`'s robots.txt read now.
    async fn fetch(fetcher: &HttpClient, origin: &str) -> Result<Rules, String> {
        let body = match fetcher.fetch_robots(origin).await {
            RobotsFetch::Found(body) => Some(Arc::new(body)),
            RobotsFetch::Missing { .. } => None,
            RobotsFetch::Unavailable(reason) => {
                return Err(format!("robots.txt unavailable: {reason}"))
            }
        };
        Ok(Rules {
            body,
            parsed: Default::default(),
            fetched: Instant::now(),
        })
    }

    /// The sitemaps `origin`'s robots.txt names (its `Sitemap:` lines, whoever the agent): from
    /// the cache while it is fresh, else read now (and cached) — even with robots.txt turned
    /// off, as this is where the site says where its sitemaps are. A file that is missing (a 4xx)
    /// names none; one that cannot be read now is an error.
    pub(crate) async fn sitemaps(
        &self,
        fetcher: &HttpClient,
        origin: &str,
    ) -> Result<Vec<String>, String> {
        let slot = self
            .hosts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(origin.to_owned())
            .or_default()
            .clone();
        let cached = |slot: &Origin| {
            slot.rules
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .filter(|r| r.fetched.elapsed() < self.ttl)
                .map(|r| r.body.clone())
        };
        let body = match cached(&slot) {
            Some(body) => body,
            None => {
                let _fetching = slot.fetching.lock().await;
                match cached(&slot) {
                    Some(body) => body,
                    None => {
                        let rules = Self::fetch(fetcher, origin).await?;
                        let body = rules.body.clone();
                        *slot.rules.write().unwrap_or_else(|p| p.into_inner()) = Some(rules);
                        body
                    }
                }
            }
        };
        Ok(body.map_or_else(Vec::new, |b| sitemap_lines(&b)))
    }
}

/// The `Sitemap:` lines of a robots.txt (RFC 9309 §2.2.4: independent of any group), in order,
/// each once.
fn sitemap_lines(body: &[u8]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in String::from_utf8_lossy(body).lines() {
        let line = line.split('#').next().unwrap_or("");
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if key.trim().eq_ignore_ascii_case("sitemap")
            && !value.is_empty()
            && !out.iter().any(|v| v == value)
        {
            out.push(value.to_owned());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sitemap_lines_are_read_whatever_the_group() {
        let txt = b"User-agent: *\nDisallow: /x\nSITEMAP: http://a/s.xml # main\n\nUser-agent: b\nsitemap:http://a/t.xml.gz\nSitemap: http://a/s.xml\nSitemap:\n";
        assert_eq!(sitemap_lines(txt), ["http://a/s.xml", "http://a/t.xml.gz"]);
    }

    #[test]
    fn the_product_token_names_the_agent() {
        assert_eq!(product_token("seedlock/0.1.0"), "seedlock");
        assert_eq!(product_token("MyBot (+https://x)"), "MyBot");
        assert_eq!(product_token(""), "*");
    }

    #[test]
    fn rules_for_our_token_apply_and_others_do_not() {
        let txt = b"User-agent: seedlock\nDisallow: /private\nCrawl-delay: 0.5\n\nUser-agent: *\nDisallow: /\n";
        let robot = Robot::new("seedlock", txt).unwrap();
        assert!(!robot.allowed("http://a/private/x"));
        assert!(robot.allowed("http://a/list/1"));
        assert_eq!(robot.delay, Some(0.5));
        let other = Robot::new("otherbot", txt).unwrap();
        assert!(!other.allowed("http://a/list/1"));
    }
}
