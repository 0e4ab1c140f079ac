//! Identifier newtypes: a value of these types has already been validated, so the rest of the
//! code never re-checks a bot id, an instance id or a fencing epoch.

use std::fmt;

/// A bot's id: the `_id` of its document in `bots`. 1–64 characters of `[A-Za-z0-9_.-]`, so it is
/// safe in a metric label, a log field and a mongosh query without quoting surprises.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BotId(String);

impl BotId {
    pub fn parse(raw: &str) -> Result<Self, String> {
        if raw.is_empty() || raw.len() > 64 {
            return Err(format!("bot id {raw:?} must be 1 to 64 characters long"));
        }
        if let Some(bad) = raw
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
        {
            return Err(format!(
                "bot id {raw:?} has the character {bad:?}; use letters, digits, '_', '-' and '.'"
            ));
        }
        Ok(Self(raw.to_owned()))
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for BotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Who holds a lock: written to `editingBy` and to every history entry.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InstanceId(String);

impl InstanceId {
    pub fn parse(raw: &str) -> Result<Self, String> {
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.len() > 200 {
            return Err(format!(
                "instance id {raw:?} must be 1 to 200 characters long"
            ));
        }
        if trimmed.chars().any(char::is_control) {
            return Err(format!("instance id {raw:?} has a control character"));
        }
        Ok(Self(trimmed.to_owned()))
    }

    /// `hostname:pid:random`, unique enough that two processes never share one by accident.
    pub(crate) fn generate() -> Self {
        let host = gethostname::gethostname().to_string_lossy().into_owned();
        let host = if host.is_empty() {
            "host".to_owned()
        } else {
            host
        };
        let suffix: u32 = rand::random();
        Self(format!("{host}:{}:{suffix:08x}", std::process::id()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The fencing token: `lockEpoch` in the bot document. Every acquisition, takeover, repair and
/// admin unlock increments it, and every holder write filters on the epoch it acquired, so a
/// stale holder's late writes match nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct LockEpoch(i64);

impl LockEpoch {
    pub const ZERO: LockEpoch = LockEpoch(0);

    pub fn new(value: i64) -> Result<Self, String> {
        if value < 0 {
            return Err(format!("lockEpoch {value} is negative"));
        }
        Ok(Self(value))
    }

    pub fn get(self) -> i64 {
        self.0
    }

    /// The epoch after this one; `None` at the Int64 maximum (an epoch is never handed out twice,
    /// so it does not wrap or saturate).
    pub(crate) fn next(self) -> Option<Self> {
        self.0.checked_add(1).map(Self)
    }
}

impl fmt::Display for LockEpoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A bot's crawl pass: `crawlPass` in its document, `pass` on its frontier entries, `listedPass`
/// on a listing page's manifest. 0 before the bot's first pass; each pass is the one before it
/// plus one. Read from a document, a negative number is refused where the document is parsed
/// (`crawlPass`) or counts as no pass (an entry's), so a value here is never negative.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct PassNumber(i64);

impl PassNumber {
    /// No pass yet.
    pub(crate) const NONE: PassNumber = PassNumber(0);

    /// The pass numbered `value`; a negative one is no pass ([`PassNumber::NONE`]).
    pub const fn new(value: i64) -> Self {
        if value < 0 {
            Self::NONE
        } else {
            Self(value)
        }
    }

    pub(crate) const fn get(self) -> i64 {
        self.0
    }

    /// The pass after this one (saturating at the Int64 maximum, which no bot reaches).
    pub(crate) const fn next(self) -> Self {
        Self(self.0.saturating_add(1))
    }
}

impl fmt::Display for PassNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl From<PassNumber> for bson::Bson {
    fn from(pass: PassNumber) -> Self {
        bson::Bson::Int64(pass.0)
    }
}

/// The first `bytes` bytes of the SHA-256 of `chunks` (concatenated), as lower-case hex: the one
/// way seedlock derives ids, content hashes and digests from data.
/// The first 8 bytes of the SHA-256 of `chunks`, as a number (big-endian).
pub(crate) fn sha256_u64(chunks: &[&[u8]]) -> u64 {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for chunk in chunks {
        hasher.update(chunk);
    }
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

pub(crate) fn sha256_hex(chunks: &[&[u8]], bytes: usize) -> String {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for chunk in chunks {
        hasher.update(chunk);
    }
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = hasher.finalize();
    let mut out = String::with_capacity(2 * bytes.min(digest.len()));
    for b in digest.iter().take(bytes) {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bot_ids_accept_the_safe_alphabet_only() {
        assert!(BotId::parse("shop-1.eu_west").is_ok());
        for bad in ["", "a b", "shop$", "x/y", &"a".repeat(65)] {
            assert!(BotId::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn instance_ids_are_trimmed_and_generated_ones_parse() {
        assert_eq!(InstanceId::parse("  a:1 ").unwrap().as_str(), "a:1");
        assert!(InstanceId::parse("   ").is_err());
        assert!(InstanceId::parse("a\nb").is_err());
        let generated = InstanceId::generate();
        assert_eq!(
            InstanceId::parse(generated.as_str()).unwrap(),
            generated,
            "a generated id must be a valid id"
        );
        assert_ne!(InstanceId::generate(), InstanceId::generate());
    }

    #[test]
    fn hashes_are_hex_of_the_requested_length() {
        assert_eq!(sha256_hex(&[b"a", b"bc"], 4), sha256_hex(&[b"abc"], 4));
        assert_eq!(sha256_hex(&[b"abc"], 4), "ba7816bf", "SHA-256 of \"abc\"");
        assert_eq!(sha256_hex(&[], 16).len(), 32);
    }

    #[test]
    fn epochs_are_non_negative_and_increase() {
        assert!(LockEpoch::new(-1).is_err());
        assert_eq!(
            LockEpoch::new(4).unwrap().next().map(LockEpoch::get),
            Some(5)
        );
        assert_eq!(LockEpoch::new(i64::MAX).unwrap().next(), None);
    }
}
