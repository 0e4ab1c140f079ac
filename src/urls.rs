//! URL normalization: a [`NormalizedUrl`] is an absolute http(s) URL with a lower-case scheme and
//! host, no default port, no fragment and no credentials, so two spellings of one page compare equal.

use std::fmt;

use url::Url;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NormalizedUrl(String);

impl NormalizedUrl {
    pub fn parse(raw: &str) -> Result<Self, String> {
        let trimmed = raw.trim();
        let mut url = Url::parse(trimmed).map_err(|e| format!("{trimmed:?} is not a URL ({e})"))?;
        Self::from_url(&mut url).map_err(|why| format!("{trimmed:?} {why}"))
    }

    /// Resolves `raw` against `base` (for relative links in a sitemap), then normalizes it.
    pub fn parse_relative(base: &Url, raw: &str) -> Result<Self, String> {
        let trimmed = raw.trim();
        let mut url = base
            .join(trimmed)
            .map_err(|e| format!("{trimmed:?} is not a URL ({e})"))?;
        Self::from_url(&mut url).map_err(|why| format!("{trimmed:?} {why}"))
    }

    fn from_url(url: &mut Url) -> Result<Self, &'static str> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err("is not an http(s) URL");
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err("has no host");
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err("carries credentials, which seeds must not");
        }
        // `url` already lower-cases the scheme and host and drops a default port.
        url.set_fragment(None);
        if url.query() == Some("") {
            url.set_query(None);
        }
        Ok(Self(url.as_str().to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn to_url(&self) -> Url {
        Url::parse(&self.0).expect("a NormalizedUrl is always a valid URL")
    }
}

impl fmt::Display for NormalizedUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_of_one_page_normalize_equal() {
        let a = NormalizedUrl::parse("HTTP://Example.COM:80/a?x=1#top").unwrap();
        let b = NormalizedUrl::parse(" http://example.com/a?x=1 ").unwrap();
        assert_eq!(a, b);
        assert_eq!(a.as_str(), "http://example.com/a?x=1");
        assert_eq!(
            NormalizedUrl::parse("https://h/?").unwrap().as_str(),
            "https://h/"
        );
    }

    #[test]
    fn non_web_and_credentialed_urls_are_rejected() {
        for bad in [
            "ftp://h/x",
            "mailto:a@b",
            "javascript:alert(1)",
            "/relative",
            "http://u:p@h/",
        ] {
            assert!(NormalizedUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn relative_links_resolve_against_their_base() {
        let base = Url::parse("http://h:8000/maps/index.xml").unwrap();
        assert_eq!(
            NormalizedUrl::parse_relative(&base, "part1.xml")
                .unwrap()
                .as_str(),
            "http://h:8000/maps/part1.xml"
        );
    }
}
