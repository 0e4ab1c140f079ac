//! What a selector key reads on an HTML page: a CSS match's text or attribute ([`ValueSpec`]),
//! or JSON embedded in the page read with a JSONPath — the first JSON-LD object of a
//! schema.org type (`{ jsonld = "Product", path = "$.offers.price" }`, also inside `@graph` and
//! arrays), or the JSON text of an element, such as a framework's state blob
//! (`{ css = "script#__NEXT_DATA__", path = "$.props.pageProps.sku" }`).

use std::sync::OnceLock;

use scraper::{ElementRef, Selector};
use serde_json::Value;

use super::{JsonRule, ValueSpec};

/// One way to read a value on an HTML page.
#[derive(Clone, Debug)]
pub enum HtmlRead {
    Css(ValueSpec),
    /// The first JSON-LD object whose `@type` is (or lists) `of_type`, then `path` in it.
    JsonLd {
        of_type: String,
        path: JsonRule,
    },
    /// The JSON text of the first element `selector` (written `css`) matches, then `path`.
    InElement {
        selector: Selector,
        css: String,
        path: JsonRule,
    },
}

fn json_ld_scripts() -> &'static Selector {
    static SELECTOR: OnceLock<Selector> = OnceLock::new();
    SELECTOR.get_or_init(|| {
        Selector::parse(r#"script[type="application/ld+json"]"#).expect("a valid selector")
    })
}

impl HtmlRead {
    /// As the bot wrote it.
    pub(crate) fn describe(&self) -> String {
        match self {
            Self::Css(spec) => spec.as_str().to_owned(),
            Self::JsonLd { of_type, path } => {
                format!("{{ jsonld = {of_type:?}, path = {:?} }}", path.as_str())
            }
            Self::InElement { css, path, .. } => {
                format!("{{ css = {css:?}, path = {:?} }}", path.as_str())
            }
        }
    }

    /// The values inside `scope` — every one with `all`, else the first — a CSS match as a
    /// string (trimmed, white space collapsed), embedded JSON as it is. `Err` when the embedded
    /// JSON it needs is broken.
    pub(crate) fn values(&self, scope: ElementRef<'_>, all: bool) -> Result<Vec<Value>, String> {
        match self {
            Self::Css(spec) => {
                let found = if all {
                    spec.read_all(scope)
                } else {
                    spec.read(scope).into_iter().collect()
                };
                Ok(found.into_iter().map(Value::String).collect())
            }
            Self::JsonLd { of_type, path } => {
                let Some(object) = json_ld(scope, of_type)? else {
                    return Ok(Vec::new());
                };
                Ok(query(path, &object, all))
            }
            Self::InElement {
                selector,
                css,
                path,
            } => {
                let Some(element) = scope.select(selector).next() else {
                    return Ok(Vec::new());
                };
                let text: String = element.text().collect();
                let value: Value = serde_json::from_str(&text)
                    .map_err(|e| format!("the JSON in {css:?} is not valid JSON ({e})"))?;
                Ok(query(path, &value, all))
            }
        }
    }

    /// The first value as text, as listing keys and natural keys read it.
    pub(crate) fn text(&self, scope: ElementRef<'_>) -> Result<Option<String>, String> {
        Ok(self
            .values(scope, false)?
            .first()
            .and_then(super::json::text))
    }
}

/// What `path` selects in `value`: every node with `all`, else the first.
fn query(path: &JsonRule, value: &Value, all: bool) -> Vec<Value> {
    let nodes = path.path.query(value);
    if all {
        nodes.all().into_iter().cloned().collect()
    } else {
        nodes.first().cloned().into_iter().collect()
    }
}

/// The first JSON-LD object of `of_type` inside `scope`. A script that is not valid JSON is an
/// error only when no valid one holds such an object.
fn json_ld(scope: ElementRef<'_>, of_type: &str) -> Result<Option<Value>, String> {
    let mut broken = None;
    for script in scope.select(json_ld_scripts()) {
        let text: String = script.text().collect();
        match serde_json::from_str::<Value>(&text) {
            Ok(value) => {
                if let Some(found) = of_schema_type(&value, of_type) {
                    return Ok(Some(found.clone()));
                }
            }
            Err(e) => {
                broken.get_or_insert(format!("a JSON-LD script is not valid JSON ({e})"));
            }
        }
    }
    broken.map_or(Ok(None), Err)
}

/// The first object in `value` (itself, an array's items, an `@graph`'s) whose `@type` is, or
/// lists, `of_type` (also as a full IRI, `https://schema.org/Product`).
fn of_schema_type<'v>(value: &'v Value, of_type: &str) -> Option<&'v Value> {
    let names = |t: &Value| match t {
        Value::String(s) => s == of_type || s.ends_with(&format!("/{of_type}")),
        _ => false,
    };
    match value {
        Value::Array(items) => items.iter().find_map(|v| of_schema_type(v, of_type)),
        Value::Object(map) => {
            let typed = match map.get("@type") {
                Some(Value::Array(types)) => types.iter().any(names),
                Some(t) => names(t),
                None => false,
            };
            if typed {
                return Some(value);
            }
            map.get("@graph").and_then(|g| of_schema_type(g, of_type))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use scraper::Html;

    fn ld(of_type: &str, path: &str) -> HtmlRead {
        HtmlRead::JsonLd {
            of_type: of_type.into(),
            path: JsonRule::parse(path).unwrap(),
        }
    }

    fn read(html: &str, how: &HtmlRead, all: bool) -> Result<Vec<Value>, String> {
        let doc = Html::parse_document(html);
        how.values(doc.root_element(), all)
    }

    const PRODUCT: &str = r#"<script type="application/ld+json">{"@context": "https://schema.org",
        "@graph": [{"@type": "BreadcrumbList"},
                   {"@type": ["Thing", "Product"], "sku": "S-1", "offers": [{"price": "9.99"}, {"price": 12}]}]}</script>"#;

    #[test]
    fn json_ld_is_found_by_type_in_graphs_and_arrays() {
        let price = ld("Product", "$.offers[*].price");
        assert_eq!(
            read(PRODUCT, &price, true).unwrap(),
            [serde_json::json!("9.99"), serde_json::json!(12)]
        );
        assert_eq!(
            read(PRODUCT, &price, false).unwrap(),
            [serde_json::json!("9.99")]
        );
        let array = r#"<script type="application/ld+json">[{"@type": "Organization"},
            {"@type": "https://schema.org/Product", "sku": 7}]</script>"#;
        assert_eq!(
            ld("Product", "$.sku").text(Html::parse_document(array).root_element()),
            Ok(Some("7".into()))
        );
        assert_eq!(read(PRODUCT, &ld("Offer", "$.price"), false), Ok(vec![]));
        assert_eq!(read("<p>no scripts</p>", &price, false), Ok(vec![]));
    }

    #[test]
    fn broken_embedded_json_is_an_error_unless_a_valid_script_answers() {
        let broken = r#"<script type="application/ld+json">{"@type": "Product", "sku": }</script>"#;
        let sku = ld("Product", "$.sku");
        let why = read(broken, &sku, false).unwrap_err();
        assert!(
            why.starts_with("a JSON-LD script is not valid JSON ("),
            "{why}"
        );
        let both = format!("{broken}{PRODUCT}");
        assert_eq!(read(&both, &sku, false), Ok(vec![serde_json::json!("S-1")]));
        let blob = HtmlRead::InElement {
            selector: Selector::parse("script#__NEXT_DATA__").unwrap(),
            css: "script#__NEXT_DATA__".into(),
            path: JsonRule::parse("$.props.pageProps.sku").unwrap(),
        };
        let next = r#"<script id="__NEXT_DATA__" type="application/json">{"props": {"pageProps": {"sku": "N-1"}}}</script>"#;
        assert_eq!(read(next, &blob, false), Ok(vec![serde_json::json!("N-1")]));
        let bad = r#"<script id="__NEXT_DATA__">{"props": </script>"#;
        let why = read(bad, &blob, false).unwrap_err();
        assert!(
            why.starts_with("the JSON in \"script#__NEXT_DATA__\" is not valid JSON ("),
            "{why}"
        );
        assert_eq!(read("<p></p>", &blob, false), Ok(vec![]));
    }
}
