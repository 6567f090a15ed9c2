//! containerd's filter language (`filters` package), as `List` receives it:
//! each string is a conjunction of selectors `fieldpath [op value]` joined by
//! `,`; the list matches if any string matches. Field paths are `.`-joined
//! fields, each a word or a quoted string (`labels."containerd.io/snapshot.ref"`);
//! operators are `==`, `!=` and `~=` (regular expression); a value is a quoted
//! string or a run of characters up to `,` or white space (so
//! `sha256:abc...` needs no quotes). A selector without operator tests that
//! the field is present. containerd 1.6 sends
//! `labels."containerd.io/snapshot.ref"==<chainID>,parent=="<parent>"` after
//! a remote `Prepare`.

use regex::Regex;

/// Fields a snapshot offers to filters (`name`, `parent`, `kind`, `labels.<key>`).
pub trait Fields {
    /// The value at `path`, or `None` when the field is absent.
    fn field(&self, path: &[String]) -> Option<String>;
}

/// A parsed list of filters: matches when any of them matches (all when empty).
#[derive(Debug, Default)]
pub struct FilterSet(Vec<Vec<Selector>>);

#[derive(Debug)]
struct Selector {
    path: Vec<String>,
    op: Op,
}

#[derive(Debug)]
enum Op {
    Present,
    Equal(String),
    NotEqual(String),
    Matches(Regex),
}

/// A filter string that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("filter {filter:?} at byte {at}: {reason}")]
pub struct FilterError {
    filter: String,
    at: usize,
    reason: String,
}

impl FilterSet {
    /// Parses containerd filter strings.
    pub fn parse(filters: &[String]) -> Result<FilterSet, FilterError> {
        filters
            .iter()
            .filter(|f| !f.trim().is_empty())
            .map(|f| Parser { s: f, pos: 0 }.conjunction())
            .collect::<Result<_, _>>()
            .map(FilterSet)
    }

    /// Whether `item` passes.
    pub fn matches(&self, item: &impl Fields) -> bool {
        self.0.is_empty() || self.0.iter().any(|c| c.iter().all(|s| s.matches(item)))
    }
}

impl Selector {
    fn matches(&self, item: &impl Fields) -> bool {
        let value = item.field(&self.path);
        match &self.op {
            Op::Present => value.is_some(),
            Op::Equal(v) => value.as_deref() == Some(v.as_str()),
            Op::NotEqual(v) => value.as_deref().unwrap_or("") != v,
            Op::Matches(re) => value.is_some_and(|v| re.is_match(&v)),
        }
    }
}

struct Parser<'a> {
    s: &'a str,
    pos: usize,
}

impl Parser<'_> {
    fn error(&self, reason: impl Into<String>) -> FilterError {
        FilterError {
            filter: self.s.to_string(),
            at: self.pos,
            reason: reason.into(),
        }
    }

    fn peek(&self) -> Option<char> {
        self.s[self.pos..].chars().next()
    }

    fn skip_space(&mut self) {
        while let Some(c) = self.peek().filter(|c| c.is_whitespace()) {
            self.pos += c.len_utf8();
        }
    }

    fn conjunction(mut self) -> Result<Vec<Selector>, FilterError> {
        let mut selectors = vec![self.selector()?];
        loop {
            self.skip_space();
            match self.peek() {
                None => return Ok(selectors),
                Some(',') => {
                    self.pos += 1;
                    selectors.push(self.selector()?);
                }
                Some(c) => return Err(self.error(format!("expected ',' or the end, found {c:?}"))),
            }
        }
    }

    fn selector(&mut self) -> Result<Selector, FilterError> {
        let mut path = vec![self.field()?];
        while self.peek() == Some('.') {
            self.pos += 1;
            path.push(self.field()?);
        }
        self.skip_space();
        let rest = &self.s[self.pos..];
        let op = if let Some(op) = ["==", "!=", "~="].into_iter().find(|o| rest.starts_with(o)) {
            self.pos += 2;
            self.skip_space();
            let value = self.value()?;
            match op {
                "==" => Op::Equal(value),
                "!=" => Op::NotEqual(value),
                _ => Op::Matches(
                    Regex::new(&value).map_err(|e| self.error(format!("bad regexp: {e}")))?,
                ),
            }
        } else {
            Op::Present
        };
        Ok(Selector { path, op })
    }

    fn field(&mut self) -> Result<String, FilterError> {
        self.skip_space();
        match self.peek() {
            Some(q @ ('"' | '/' | '|')) => self.quoted(q),
            Some(c) if c.is_ascii_alphanumeric() || c == '_' => {
                let start = self.pos;
                while self
                    .peek()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
                {
                    self.pos += 1;
                }
                Ok(self.s[start..self.pos].to_string())
            }
            other => Err(self.error(format!("expected a field name, found {other:?}"))),
        }
    }

    fn value(&mut self) -> Result<String, FilterError> {
        match self.peek() {
            Some(q @ ('"' | '/' | '|')) => self.quoted(q),
            _ => {
                let start = self.pos;
                while let Some(c) = self.peek().filter(|&c| c != ',' && !c.is_whitespace()) {
                    self.pos += c.len_utf8();
                }
                Ok(self.s[start..self.pos].to_string())
            }
        }
    }

    /// A string between `quote`s, with Go's backslash escapes.
    fn quoted(&mut self, quote: char) -> Result<String, FilterError> {
        self.pos += 1;
        let mut out = String::new();
        loop {
            let c = self
                .peek()
                .ok_or_else(|| self.error("quoted string not terminated"))?;
            self.pos += c.len_utf8();
            if c == quote {
                return Ok(out);
            }
            if c != '\\' {
                out.push(c);
                continue;
            }
            let e = self
                .peek()
                .ok_or_else(|| self.error("quoted string not terminated"))?;
            self.pos += e.len_utf8();
            out.push(match e {
                'a' => '\x07',
                'b' => '\x08',
                'f' => '\x0c',
                'n' => '\n',
                'r' => '\r',
                't' => '\t',
                'v' => '\x0b',
                '\\' => '\\',
                e if e == quote => e,
                'x' | 'u' | 'U' => {
                    let n = match e {
                        'x' => 2,
                        'u' => 4,
                        _ => 8,
                    };
                    let digits = self.s.get(self.pos..self.pos + n).unwrap_or("");
                    let c = u32::from_str_radix(digits, 16)
                        .ok()
                        .and_then(char::from_u32)
                        .ok_or_else(|| self.error("illegal escape sequence"))?;
                    self.pos += n;
                    c
                }
                _ => return Err(self.error(format!("illegal escape sequence \\{e}"))),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    struct Item {
        name: &'static str,
        parent: &'static str,
        labels: BTreeMap<String, String>,
    }

    impl Fields for Item {
        fn field(&self, path: &[String]) -> Option<String> {
            match path.first()?.as_str() {
                "name" => Some(self.name.into()),
                "parent" => Some(self.parent.into()),
                "labels" => self.labels.get(&path[1..].join(".")).cloned(),
                _ => None,
            }
        }
    }

    fn item(name: &'static str, parent: &'static str, r: Option<&str>) -> Item {
        let labels = r
            .map(|r| ("containerd.io/snapshot.ref".to_string(), r.to_string()))
            .into_iter()
            .collect();
        Item {
            name,
            parent,
            labels,
        }
    }

    fn set(f: &[&str]) -> FilterSet {
        FilterSet::parse(&f.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn the_filter_containerd_sends_after_a_remote_prepare_selects_label_and_parent() {
        let f = set(&[r#"labels."containerd.io/snapshot.ref"==sha256:c2,parent=="sha256:c1""#]);
        assert!(f.matches(&item("sha256:c2", "sha256:c1", Some("sha256:c2"))));
        assert!(!f.matches(&item("sha256:c2", "other", Some("sha256:c2"))));
        assert!(!f.matches(&item("sha256:c2", "sha256:c1", None)));
        let first = set(&[r#"labels."containerd.io/snapshot.ref"==sha256:c1,parent=="""#]);
        assert!(first.matches(&item("sha256:c1", "", Some("sha256:c1"))));
    }

    #[test]
    fn filters_are_alternatives_and_operators_follow_containerd() {
        let f = set(&["name==a", "name==b"]);
        assert!(f.matches(&item("b", "", None)));
        assert!(!f.matches(&item("c", "", None)));
        assert!(set(&["name!=a"]).matches(&item("b", "", None)));
        assert!(set(&["name~=^k8s\\.io/"]).matches(&item("k8s.io/3/x", "", None)));
        assert!(
            set(&[r#"labels."containerd.io/snapshot.ref""#]).matches(&item("a", "", Some("r")))
        );
        assert!(!set(&[r#"labels."containerd.io/snapshot.ref""#]).matches(&item("a", "", None)));
        assert!(set(&[]).matches(&item("a", "", None)));
    }

    #[test]
    fn a_malformed_filter_says_where() {
        let e = FilterSet::parse(&["name==a,".into()]).unwrap_err();
        assert!(e.to_string().contains("at byte 8"), "{e}");
        assert!(FilterSet::parse(&[r#"labels."unterminated"#.into()]).is_err());
    }
}
