//! Component settings from TOML text, with errors an operator can act on.
//!
//! The agent and the tracker each read one typed settings struct from a TOML
//! file. A mistake is reported on one line with its line, column and the
//! dotted key it concerns (`peer.request_timeout`), not as toml's multi-line
//! snippet, so that it survives log collectors and reads in `kubectl logs`.
//! This module parses text only; the callers read the file and name it.
//!
//! Every duration in every component's settings is written one way (see
//! [`duration`]): whole milliseconds, or a string with units. Keys carry no
//! unit suffix; the older `_ms` keys are read as aliases, and the few older
//! `_s` keys (whole seconds) as deprecated keys, each named in a warning.

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

/// Serde for durations: whole milliseconds (`20000`) or a string with units
/// (`"20s"`, `"1m 30s"`, `"500ms"`); written back as milliseconds. Use with
/// `#[serde(with = "dray_protocol::settings::duration")]`.
pub mod duration {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Written {
        Millis(u64),
        Text(String),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        match Written::deserialize(d).map_err(|_| {
            D::Error::custom("expected a duration: milliseconds, or a string such as \"20s\"")
        })? {
            Written::Millis(ms) => Ok(Duration::from_millis(ms)),
            Written::Text(t) => humantime::parse_duration(&t).map_err(|_| {
                D::Error::custom(format!(
                    "{t:?} is not a duration; write milliseconds, or a string such as \"20s\" or \"500ms\""
                ))
            }),
        }
    }
}

/// A deprecated key in whole seconds (`ban_s = 600`) that a duration key
/// (`ban = "10m"`) replaced: its value, if written, wins, and the warning
/// to log says what to write instead.
pub fn deprecated_seconds(
    old: &str,
    new: &str,
    written: Option<u64>,
    current: std::time::Duration,
) -> (std::time::Duration, Option<String>) {
    match written {
        None => (current, None),
        Some(s) => (
            std::time::Duration::from_secs(s),
            Some(format!(
                "`{old}` is deprecated: write `{new} = \"{s}s\"` (or milliseconds, `{new} = {}`)",
                s.saturating_mul(1000)
            )),
        ),
    }
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

    #[derive(Debug, Default, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Timed {
        #[serde(with = "duration", alias = "wait_ms")]
        wait: std::time::Duration,
    }

    #[test]
    fn durations_take_milliseconds_or_units_and_the_ms_alias() {
        for (written, want) in [
            ("wait = 1500", 1500),
            ("wait = \"1s 500ms\"", 1500),
            ("wait = \"2m\"", 120_000),
            ("wait_ms = 250", 250),
        ] {
            let t = from_toml::<Timed>(written).unwrap();
            assert_eq!(t.wait, std::time::Duration::from_millis(want), "{written}");
        }
        let e = from_toml::<Timed>("wait = \"soon\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("key `wait`: \"soon\" is not a duration"), "{e}");
        let e = from_toml::<Timed>("wait_ms = -5").unwrap_err().to_string();
        assert!(e.contains("key `wait_ms`: expected a duration"), "{e}");
    }

    #[test]
    fn a_deprecated_seconds_key_wins_and_says_what_to_write() {
        let now = std::time::Duration::from_secs(600);
        assert_eq!(deprecated_seconds("ban_s", "ban", None, now), (now, None));
        let (d, warning) = deprecated_seconds("ban_s", "ban", Some(30), now);
        assert_eq!(d, std::time::Duration::from_secs(30));
        assert_eq!(
            warning.unwrap(),
            "`ban_s` is deprecated: write `ban = \"30s\"` (or milliseconds, `ban = 30000`)"
        );
    }

    #[test]
    fn missing_keys_take_defaults() {
        let o = from_toml::<Outer>("name = \"a\"\n").unwrap();
        assert_eq!((o.name.as_str(), o.inner.count), ("a", 0));
    }
}
