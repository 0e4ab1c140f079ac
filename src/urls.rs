//! URL normalization: a [`NormalizedUrl`] is an absolute http(s) URL with a lower-case scheme and
//! host, no default port, no fragment, no credentials, its query parameters sorted and tracking
//! parameters ([`StripQuery`]) removed, so two spellings of one page compare equal.

use std::fmt;

use url::Url;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NormalizedUrl(String);

/// Query parameters that normalization removes: exact names, or prefixes written `utm_*`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StripQuery {
    exact: Vec<String>,
    prefixes: Vec<String>,
}

impl StripQuery {
    pub fn parse(patterns: &[String]) -> Result<Self, String> {
        let mut strip = StripQuery::default();
        for pattern in patterns {
            let pattern = pattern.trim();
            match pattern.strip_suffix('*') {
                Some(prefix) if !prefix.is_empty() && !prefix.contains('*') => {
                    strip.prefixes.push(prefix.to_owned())
                }
                None if !pattern.is_empty() && !pattern.contains('*') => {
                    strip.exact.push(pattern.to_owned())
                }
                _ => {
                    return Err(format!(
                        "{pattern:?} is not a parameter name or a prefix such as \"utm_*\""
                    ))
                }
            }
        }
        Ok(strip)
    }

    pub(crate) fn matches(&self, name: &str) -> bool {
        self.exact.iter().any(|e| e == name)
            || self.prefixes.iter().any(|p| name.starts_with(p.as_str()))
    }
}

impl NormalizedUrl {
    pub fn parse(raw: &str) -> Result<Self, String> {
        Self::parse_with(raw, &StripQuery::default())
    }

    /// Parses and normalizes, removing the query parameters `strip` names.
    pub(crate) fn parse_with(raw: &str, strip: &StripQuery) -> Result<Self, String> {
        let trimmed = raw.trim();
        let mut url = Url::parse(trimmed).map_err(|e| format!("{trimmed:?} is not a URL ({e})"))?;
        Self::from_url(&mut url, strip).map_err(|why| format!("{trimmed:?} {why}"))
    }

    /// Resolves `raw` against `base` (for relative links in a sitemap), then normalizes it.
    pub(crate) fn parse_relative(base: &Url, raw: &str) -> Result<Self, String> {
        Self::join_with(base, raw, &StripQuery::default())
    }

    /// Resolves `raw` against `base` (a link on a page), then normalizes it with `strip`.
    pub fn join_with(base: &Url, raw: &str, strip: &StripQuery) -> Result<Self, String> {
        let trimmed = raw.trim();
        let mut url = base
            .join(trimmed)
            .map_err(|e| format!("{trimmed:?} is not a URL ({e})"))?;
        Self::from_url(&mut url, strip).map_err(|why| format!("{trimmed:?} {why}"))
    }

    fn from_url(url: &mut Url, strip: &StripQuery) -> Result<Self, &'static str> {
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
        if url.query().is_some() {
            let mut pairs: Vec<(String, String)> = url
                .query_pairs()
                .filter(|(name, _)| !strip.matches(name))
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect();
            pairs.sort();
            if pairs.is_empty() {
                url.set_query(None);
            } else {
                url.query_pairs_mut().clear().extend_pairs(pairs);
            }
        }
        Ok(Self(url.as_str().to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub(crate) fn to_url(&self) -> Url {
        Url::parse(&self.0).expect("a NormalizedUrl is always a valid URL")
    }

    /// `host:port`, the port spelled out even when it is the scheme's default: the unit that
    /// flow control limits and robots.txt covers.
    pub(crate) fn host_port(&self) -> String {
        let (host, port) = self.host_and_port();
        format!("{host}:{port}")
    }

    /// The host (an IPv6 address in brackets, as `Url::host_str` has it) and the port, the
    /// scheme's default when none is written — read off the normalized text, which is
    /// `scheme://host[:port]/…` with no credentials (see [`NormalizedUrl::parse_with`]), without
    /// parsing it again.
    pub(crate) fn host_and_port(&self) -> (&str, u16) {
        let (scheme, rest) = self.0.split_once("://").unwrap_or(("http", &self.0));
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let authority = &rest[..end];
        // A port follows the last ':' outside an IPv6 address's brackets.
        let port_at = authority
            .rfind(':')
            .filter(|at| !authority[*at..].contains(']'));
        match port_at.and_then(|at| Some((at, authority[at + 1..].parse::<u16>().ok()?))) {
            Some((at, port)) => (&authority[..at], port),
            None => (authority, if scheme == "https" { 443 } else { 80 }),
        }
    }

    /// `scheme://host[:port]` (where robots.txt lives).
    pub(crate) fn origin(&self) -> String {
        self.to_url().origin().ascii_serialization()
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
    fn queries_are_sorted_and_tracking_parameters_stripped() {
        let strip = StripQuery::parse(&["utm_*".into(), "ref".into()]).unwrap();
        let a = NormalizedUrl::parse_with(
            "http://h/p?b=2&utm_source=x&a=1&ref=home&referrer=k",
            &strip,
        )
        .unwrap();
        assert_eq!(a.as_str(), "http://h/p?a=1&b=2&referrer=k");
        let b = NormalizedUrl::parse_with("http://h/p?utm_medium=y&ref=z", &strip).unwrap();
        assert_eq!(b.as_str(), "http://h/p", "a query left empty is dropped");
        assert_eq!(
            NormalizedUrl::parse("http://h/p?b=2&a=1").unwrap(),
            NormalizedUrl::parse("http://h/p?a=1&b=2").unwrap()
        );
        for bad in ["", "*", "a*b*", "*x"] {
            assert!(StripQuery::parse(&[bad.into()]).is_err(), "{bad:?}");
        }
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
    fn host_and_port_read_off_the_text_agree_with_the_parser() {
        for raw in [
            "http://example.com/a",
            "https://example.com/a?x=1",
            "http://h:8000/p",
            "https://h:443/p",
            "http://[::1]:8080/x",
            "https://[2001:db8::1]/x",
            "http://127.0.0.1/",
            "http://xn--bcher-kva.example/",
        ] {
            let url = NormalizedUrl::parse(raw).unwrap();
            let parsed = url.to_url();
            let expected = (
                parsed.host_str().unwrap().to_owned(),
                parsed.port_or_known_default().unwrap(),
            );
            let (host, port) = url.host_and_port();
            assert_eq!((host.to_owned(), port), expected, "{raw}");
            assert_eq!(url.host_port(), format!("{}:{}", expected.0, expected.1));
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
