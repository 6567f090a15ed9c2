//! containerd integration: the `hosts.toml` files that make the agent's mirror
//! the first host containerd tries for a registry, with the real registry as
//! the fallback `server`.

use std::path::{Path, PathBuf};

/// What writing one `hosts.toml` did.
#[derive(Debug, PartialEq, Eq)]
pub enum HostsOutcome {
    /// The file already said exactly this.
    Unchanged,
    Written,
    /// Another file was there; it was kept at this path.
    Replaced {
        backup: PathBuf,
    },
}

/// The upstream URL containerd uses for a registry name when none is given.
pub fn default_server(registry: &str) -> String {
    match registry {
        "docker.io" => "https://registry-1.docker.io".into(),
        other => format!("https://{other}"),
    }
}

/// The directory containerd reads for every registry that has none of its
/// own (containerd 1.6 and later).
pub const DEFAULT_HOSTS: &str = "_default";

/// The `hosts.toml` text: the mirror first (pull and resolve), then `server`;
/// without one (the `_default` file) containerd falls back to each
/// registry's own default server. containerd 1.6 rejects a file without a
/// `[host]` table, so there always is one.
fn hosts_toml(server: Option<&str>, mirror: &str) -> String {
    let server = server.map_or_else(
        || "# No server: containerd goes to each registry's own default.\n".to_string(),
        |s| format!("server = \"{s}\"\n"),
    );
    format!(
        "# Written by `dray agent configure-containerd`; the previous file, if any, is kept beside it.\n\
         {server}\n\
         [host.\"{mirror}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
    )
}

/// Writes `<config_path>/<registry>/hosts.toml`, idempotently, keeping a
/// backup of a different file it replaces.
pub fn write_hosts(
    config_path: &Path,
    registry: &str,
    server: &str,
    mirror: &str,
) -> std::io::Result<HostsOutcome> {
    if registry.is_empty()
        || registry.contains('/')
        || registry.starts_with('.')
        || registry == DEFAULT_HOSTS
    {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{registry:?} is not a registry host name"),
        ));
    }
    write_file(config_path, registry, &hosts_toml(Some(server), mirror))
}

/// Writes `<config_path>/_default/hosts.toml`: every registry without a
/// directory of its own goes to the mirror first, then to itself.
pub fn write_default_hosts(config_path: &Path, mirror: &str) -> std::io::Result<HostsOutcome> {
    write_file(config_path, DEFAULT_HOSTS, &hosts_toml(None, mirror))
}

/// Writes `<config_path>/<name>/hosts.toml` beside and renames it, keeping a
/// different file it replaces as a backup.
fn write_file(config_path: &Path, name: &str, text: &str) -> std::io::Result<HostsOutcome> {
    let dir = config_path.join(name);
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("hosts.toml");
    let outcome = match std::fs::read_to_string(&path) {
        Ok(old) if old == text => return Ok(HostsOutcome::Unchanged),
        Ok(_) => {
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let backup = dir.join(format!("hosts.toml.dray-backup-{stamp}"));
            std::fs::copy(&path, &backup)?;
            HostsOutcome::Replaced { backup }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => HostsOutcome::Written,
        Err(e) => return Err(e),
    };
    // Write beside and rename, so containerd never reads half a file.
    let tmp = dir.join(".hosts.toml.dray-tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, &path)?;
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_idempotently_and_keeps_what_it_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let mirror = "http://127.0.0.1:5050";
        let server = default_server("docker.io");
        assert_eq!(
            write_hosts(dir.path(), "docker.io", &server, mirror).unwrap(),
            HostsOutcome::Written
        );
        assert_eq!(
            write_hosts(dir.path(), "docker.io", &server, mirror).unwrap(),
            HostsOutcome::Unchanged
        );
        let text = std::fs::read_to_string(dir.path().join("docker.io/hosts.toml")).unwrap();
        assert!(text.contains("server = \"https://registry-1.docker.io\""));
        assert!(
            text.contains("[host.\"http://127.0.0.1:5050\"]")
                && text.contains("capabilities = [\"pull\", \"resolve\"]")
        );
        std::fs::write(dir.path().join("docker.io/hosts.toml"), "server = \"x\"\n").unwrap();
        match write_hosts(dir.path(), "docker.io", &server, mirror).unwrap() {
            HostsOutcome::Replaced { backup } => {
                assert_eq!(std::fs::read_to_string(backup).unwrap(), "server = \"x\"\n")
            }
            other => panic!("{other:?}"),
        }
        assert!(write_hosts(dir.path(), "../etc", &server, mirror).is_err());
        assert!(write_hosts(dir.path(), DEFAULT_HOSTS, &server, mirror).is_err());
    }

    #[test]
    fn the_default_file_names_the_mirror_and_no_server() {
        let dir = tempfile::tempdir().unwrap();
        let mirror = "http://127.0.0.1:5050";
        assert_eq!(
            write_default_hosts(dir.path(), mirror).unwrap(),
            HostsOutcome::Written
        );
        let text = std::fs::read_to_string(dir.path().join("_default/hosts.toml")).unwrap();
        assert!(!text.contains("server ="), "{text}");
        assert!(text.contains("[host.\"http://127.0.0.1:5050\"]"), "{text}");
        assert_eq!(
            write_default_hosts(dir.path(), mirror).unwrap(),
            HostsOutcome::Unchanged
        );
    }
}
