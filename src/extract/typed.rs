//! Typed record fields: `type = "number" | "integer" | "string" | "bool" | "date"`, `all`
//! (every match, as an array) and `required` (a page without the value fails). Values are read
//! as JSON values (a CSS match is a string) and stored as BSON of their type, so a range query
//! in mongosh finds them. Numbers are read as people write prices: `$1,299.00`, `1.299,00 €`,
//! `1 299,00`, `12.5`.

use bson::Bson;
use serde_json::Value;

/// What a typed field holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    String,
    /// A BSON double.
    Number,
    /// A BSON Int64.
    Integer,
    Bool,
    /// A BSON date: RFC 3339, an HTTP date, `YYYY-MM-DD`, or (JSON) a number of Unix seconds.
    Date,
}

impl ValueType {
    pub(crate) fn parse(raw: &str) -> Result<Self, String> {
        Ok(match raw {
            "string" => Self::String,
            "number" => Self::Number,
            "integer" => Self::Integer,
            "bool" => Self::Bool,
            "date" => Self::Date,
            other => {
                return Err(format!(
                    "type {other:?} is not one of \"string\", \"number\", \"integer\", \"bool\", \"date\""
                ))
            }
        })
    }

    fn name(self) -> &'static str {
        match self {
            Self::String => "a string",
            Self::Number => "a number",
            Self::Integer => "an integer",
            Self::Bool => "a boolean",
            Self::Date => "a date",
        }
    }

    /// `value` as BSON of this type, or why it does not read as one.
    pub(crate) fn convert(self, value: &Value) -> Result<Bson, String> {
        let fail = || format!("{} is not {}", shown(value), self.name());
        match (self, value) {
            (Self::String, Value::String(s)) => Ok(Bson::String(s.clone())),
            (Self::String, Value::Number(_) | Value::Bool(_)) => {
                Ok(Bson::String(value.to_string()))
            }
            (Self::Number, Value::Number(n)) => n.as_f64().map(Bson::Double).ok_or_else(fail),
            (Self::Number, Value::String(s)) => parse_number(s).map(Bson::Double).ok_or_else(fail),
            (Self::Integer, Value::Number(n)) => n.as_i64().map(Bson::Int64).ok_or_else(fail),
            (Self::Integer, Value::String(s)) => parse_number(s)
                .filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15)
                .map(|f| Bson::Int64(f as i64))
                .ok_or_else(fail),
            (Self::Bool, Value::Bool(b)) => Ok(Bson::Boolean(*b)),
            (Self::Bool, Value::String(s)) => match s.trim().to_ascii_lowercase().as_str() {
                "true" | "yes" | "1" => Ok(Bson::Boolean(true)),
                "false" | "no" | "0" => Ok(Bson::Boolean(false)),
                _ => Err(fail()),
            },
            (Self::Date, Value::String(s)) => parse_date(s)
                .map(|t| Bson::DateTime(bson::DateTime::from_chrono(t)))
                .ok_or_else(fail),
            (Self::Date, Value::Number(n)) => n
                .as_f64()
                .filter(|s| s.is_finite() && s.abs() < 8.64e12)
                .and_then(|s| chrono::DateTime::from_timestamp_millis((s * 1000.0).round() as i64))
                .map(|t| Bson::DateTime(bson::DateTime::from_chrono(t)))
                .ok_or_else(fail),
            _ => Err(fail()),
        }
    }
}

/// A value as an error shows it: a string quoted, at most 60 characters.
fn shown(value: &Value) -> String {
    let text = value.to_string();
    if text.chars().count() > 60 {
        format!("{}…", text.chars().take(60).collect::<String>())
    } else {
        text
    }
}

/// A date: RFC 3339, an HTTP date, or `YYYY-MM-DD` (midnight UTC).
pub(crate) fn parse_date(raw: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    super::parse_time(raw).or_else(|| {
        chrono::NaiveDate::parse_from_str(raw.trim(), "%Y-%m-%d")
            .ok()
            .and_then(|d| d.and_hms_opt(0, 0, 0))
            .map(|t| t.and_utc())
    })
}

/// A number as people write it, currency and words around it ignored: `$1,299.00`,
/// `1.299,00 €`, `1 299,00`, `CHF 1'299.50`, `-3`, `12.5`. With both `.` and `,`, the last one
/// is the decimal mark; with only `,`, it is a thousands mark when exactly three digits follow
/// each (`1,299`), else the decimal mark (`12,5`); with only `.`, a thousands mark when it
/// appears more than once (`1.299.000`), else the decimal mark. `None` when there is no number,
/// or two.
pub(crate) fn parse_number(raw: &str) -> Option<f64> {
    let is_grouping = |c: char| matches!(c, ' ' | '\u{a0}' | '\u{202f}' | '\'' | '’');
    let chars: Vec<char> = raw.trim().chars().collect();
    let start = chars.iter().position(char::is_ascii_digit)?;
    let mut end = start;
    while end < chars.len()
        && (chars[end].is_ascii_digit()
            || matches!(chars[end], '.' | ',')
            || (is_grouping(chars[end]) && chars.get(end + 1).is_some_and(char::is_ascii_digit)))
    {
        end += 1;
    }
    let core: String = chars[start..end]
        .iter()
        .filter(|c| !is_grouping(**c))
        .collect();
    let core = core.trim_end_matches(['.', ',']);
    // A second number after this one (`1 - 2`, `3 for 10`) makes the value ambiguous.
    if chars[end..].iter().any(char::is_ascii_digit) {
        return None;
    }
    let negative = chars[..start]
        .iter()
        .rev()
        .find(|c| !c.is_whitespace())
        .is_some_and(|c| matches!(c, '-' | '−'));
    let (dots, commas) = (core.matches('.').count(), core.matches(',').count());
    let decimal = match (dots, commas) {
        (0, 0) => None,
        (_, 0) if dots > 1 => None,
        (_, 0) => Some('.'),
        (0, _) => {
            let groups_of_three = core.split(',').skip(1).all(|g| g.len() == 3);
            (!groups_of_three).then_some(',')
        }
        _ => core.rfind(['.', ',']).map(|i| core.as_bytes()[i] as char),
    };
    let (int, frac) = match decimal.and_then(|d| core.rfind(d)) {
        Some(i) => (&core[..i], &core[i + 1..]),
        None => (core, ""),
    };
    // The thousands marks group by three; the fraction has none.
    let groups: Vec<&str> = int.split(['.', ',']).collect();
    let badly_grouped = groups.len() > 1
        && (groups[0].is_empty()
            || groups[0].len() > 3
            || groups[1..].iter().any(|g| g.len() != 3));
    if badly_grouped || frac.contains(['.', ',']) {
        return None;
    }
    let mut digits = String::with_capacity(core.len() + 1);
    if negative {
        digits.push('-');
    }
    digits.extend(int.chars().filter(char::is_ascii_digit));
    if !frac.is_empty() {
        digits.push('.');
        digits.push_str(frac);
    }
    digits.parse::<f64>().ok().filter(|f| f.is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_as_people_write_prices() {
        for (raw, expected) in [
            ("$1,299.00", Some(1299.0)),
            ("1.299,00 €", Some(1299.0)),
            ("1 299,00", Some(1299.0)),
            ("1\u{a0}299,00 €", Some(1299.0)),
            ("CHF 1'299.50", Some(1299.5)),
            ("12.5", Some(12.5)),
            ("12,5", Some(12.5)),
            ("1,299", Some(1299.0)),
            ("1,299,000", Some(1_299_000.0)),
            ("1.299.000", Some(1_299_000.0)),
            ("1.299.000,50", Some(1_299_000.5)),
            ("-3", Some(-3.0)),
            ("− 4.25 USD", Some(-4.25)),
            ("Price: 7", Some(7.0)),
            ("0.99€", Some(0.99)),
            ("USD 15.", Some(15.0)),
            ("free", None),
            ("", None),
            ("1 - 2", None),
            ("3 for 10", None),
            ("1,2,3", None),
            ("1.2.3", None),
            ("12,34,567", None),
        ] {
            assert_eq!(parse_number(raw), expected, "{raw:?}");
        }
    }

    #[test]
    fn each_type_reads_its_values_and_names_what_it_cannot() {
        let s = |v: &str| Value::String(v.into());
        assert_eq!(
            ValueType::Number.convert(&s("$1,299.00")),
            Ok(Bson::Double(1299.0))
        );
        assert_eq!(
            ValueType::Number.convert(&serde_json::json!(3)),
            Ok(Bson::Double(3.0))
        );
        assert_eq!(
            ValueType::Integer.convert(&s("1,299")),
            Ok(Bson::Int64(1299))
        );
        assert_eq!(
            ValueType::Integer.convert(&s("12.5")),
            Err("\"12.5\" is not an integer".into())
        );
        assert_eq!(
            ValueType::Bool.convert(&s(" Yes ")),
            Ok(Bson::Boolean(true))
        );
        assert_eq!(
            ValueType::Bool.convert(&s("maybe")),
            Err("\"maybe\" is not a boolean".into())
        );
        let date = |raw: &str| match ValueType::Date.convert(&s(raw)) {
            Ok(Bson::DateTime(t)) => t.to_chrono().to_rfc3339(),
            other => panic!("{raw}: {other:?}"),
        };
        assert_eq!(date("2026-03-04"), "2026-03-04T00:00:00+00:00");
        assert_eq!(
            date("2026-03-04T05:06:07+01:00"),
            "2026-03-04T04:06:07+00:00"
        );
        assert_eq!(
            date("Wed, 04 Mar 2026 05:06:07 GMT"),
            "2026-03-04T05:06:07+00:00"
        );
        assert!(ValueType::Date.convert(&s("yesterday")).is_err());
        assert_eq!(
            ValueType::String.convert(&serde_json::json!(12)),
            Ok(Bson::String("12".into()))
        );
        assert!(ValueType::Number.convert(&serde_json::json!([1])).is_err());
        assert!(ValueType::parse("float")
            .unwrap_err()
            .contains("\"number\""));
    }
}
