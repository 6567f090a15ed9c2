//! Component settings from TOML text, with errors an operator can act on.
//!
//! The agent and the tracker each read one typed settings struct from a TOML
//! file. A mistake is reported on one line with its line, column and the
//! dotted key it concerns (`peer.request_timeout`), not as toml's multi-line
//! snippet, so that it survives log collectors and reads in `kubectl logs`.
//! This module parses text only; the callers read the file and name it.

use serde::de::DeserializeOwned;

/// A TOML document that does not describe the settings.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}{}{message}", position(*.line_column), key.as_ref().map(|k| format!("key `{k}`: ")).unwrap_or_default())]
pub struct SettingsError {
    /// 1-based line and column of the offending text, when toml knows it.
    pub line_column: Option<(usize, usize)>,
    /// Dotted path of the offending key, when the mistake is in a value or key.
    pub key: Option<String>,
    /// What is wrong, on one line.
    pub message: String,
}

fn position(line_column: Option<(usize, usize)>) -> String {
    line_column
        .map(|(l, c)| format!("line {l}, column {c}: "))
        .unwrap_or_default()
}

/// Parses `text` into `T`; keys missing from the text take `T`'s defaults
/// when `T` says so (`#[serde(default)]`), unknown keys are refused when `T`
/// says so (`deny_unknown_fields`).
pub fn from_toml<T: DeserializeOwned>(text: &str) -> Result<T, SettingsError> {
    let at = |e: &toml::de::Error| {
        e.span().map(|span| {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            (line, column)
        })
    };
    let one_line = |m: &str| m.split_whitespace().collect::<Vec<_>>().join(" ");
    let document = toml::Deserializer::parse(text).map_err(|e| SettingsError {
        line_column: at(&e),
        key: None,
        message: one_line(e.message()),
    })?;
    serde_path_to_error::deserialize(document).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        SettingsError {
            line_column: at(&inner),
            key: (path != ".").then_some(path),
            message: one_line(inner.message()),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Default, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Outer {
        name: String,
        inner: Inner,
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Inner {
        count: u32,
    }

    #[test]
    fn an_unknown_key_is_named_with_its_path_and_position() {
        let e = from_toml::<Outer>("name = \"a\"\n[inner]\ncuont = 3\n").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("inner.cuont"));
        assert_eq!(e.line_column, Some((3, 1)));
        assert!(e.message.contains("unknown field `cuont`"), "{e}");
        assert!(!e.to_string().contains('\n'), "{e}");
    }

    #[test]
    fn a_wrong_type_names_the_key_and_what_was_expected() {
        let e = from_toml::<Outer>("[inner]\ncount = \"three\"\n").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("inner.count"));
        assert_eq!(e.line_column, Some((2, 9)));
        assert!(e.to_string().contains("expected u32"), "{e}");
    }

    #[test]
    fn broken_syntax_is_reported_by_position() {
        let e = from_toml::<Outer>("name = \"a\"\n[inner\n").unwrap_err();
        assert_eq!(e.key, None);
        assert_eq!(e.line_column.map(|(l, _)| l), Some(2));
        assert!(!e.to_string().contains('\n'), "{e}");
    }

    #[test]
    fn missing_keys_take_defaults() {
        let o = from_toml::<Outer>("name = \"a\"\n").unwrap();
        assert_eq!((o.name.as_str(), o.inner.count), ("a", 0));
    }
}
