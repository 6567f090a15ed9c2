//! Configuration mistakes as an operator meets them: `dray agent` and `dray
//! tracker` refuse a bad file with one line naming the file, the position, the
//! key and the problem, and a bad flag or environment value with clap's error.

use std::path::Path;
use std::process::Command;

/// Runs `dray ARGS` with `env`, expecting failure; returns its stderr.
fn fails(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_dray"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(!out.status.success(), "dray {args:?} succeeded");
    String::from_utf8(out.stderr).unwrap()
}

/// Writes `text` as `name` in `dir`, runs `dray COMMAND -c FILE`, and checks the
/// error is exactly one line that names the file and contains `want`.
fn refused(dir: &Path, command: &str, name: &str, text: &str, want: &str) {
    let file = dir.join(name);
    std::fs::write(&file, text).unwrap();
    let err = fails(&[command, "-c", file.to_str().unwrap()], &[]);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("dray: configuration: "), "{err}");
    assert!(err.contains(file.to_str().unwrap()), "{err}");
    assert!(err.contains(want), "{err}");
}

#[test]
fn an_unknown_key_is_refused_with_its_path_and_line() {
    let dir = tempfile::tempdir().unwrap();
    refused(
        dir.path(),
        "agent",
        "agent.toml",
        "state_dir = \"/tmp/x\"\n[swarm]\ntrackers = []\nstal_ms = 100\n",
        "line 4, column 1: key `swarm.stal_ms`: unknown field `stal_ms`, expected one of",
    );
    refused(
        dir.path(),
        "tracker",
        "tracker.toml",
        "listen = \"127.0.0.1:0\"\npeers_per_node = 3\n",
        "line 2, column 1: key `peers_per_node`: unknown field `peers_per_node`",
    );
}

#[test]
fn a_wrong_type_is_refused_with_the_key_and_the_expected_type() {
    let dir = tempfile::tempdir().unwrap();
    refused(
        dir.path(),
        "agent",
        "agent.toml",
        "[peer]\nmax_uploads = \"many\"\n",
        "line 2, column 15: key `peer.max_uploads`: invalid type: string \"many\", expected usize",
    );
    refused(
        dir.path(),
        "tracker",
        "tracker.toml",
        "listen = \"localhost\"\n",
        "key `listen`: invalid socket address syntax",
    );
}

#[test]
fn a_bad_duration_is_refused_with_how_to_write_one() {
    let dir = tempfile::tempdir().unwrap();
    refused(
        dir.path(),
        "agent",
        "agent.toml",
        "[peer]\nrequest_timeout = \"20 parsecs\"\n",
        "key `peer.request_timeout`: \"20 parsecs\" is not a duration; write milliseconds, or a string such as \"20s\"",
    );
    refused(
        dir.path(),
        "tracker",
        "tracker.toml",
        "announce_interval_ms = -5\n",
        "key `announce_interval_ms`: expected a duration: milliseconds, or a string such as \"20s\"",
    );
}

#[test]
fn a_missing_file_is_named() {
    let err = fails(&["agent", "-c", "/nonexistent/agent.toml"], &[]);
    assert_eq!(
        err.trim_end(),
        "dray: configuration: cannot read /nonexistent/agent.toml: No such file or directory (os error 2)"
    );
    let err = fails(
        &["tracker"],
        &[("DRAY_TRACKER_CONFIG", "/nonexistent/t.toml")],
    );
    assert_eq!(
        err.trim_end(),
        "dray: configuration: cannot read /nonexistent/t.toml: No such file or directory (os error 2)"
    );
}

#[test]
fn a_bad_flag_or_environment_value_is_a_clap_error_naming_it() {
    let err = fails(&["agent", "--peer-listen", "nonsense"], &[]);
    assert!(
        err.contains("invalid value 'nonsense' for '--peer-listen <PEER_LISTEN>'"),
        "{err}"
    );
    let err = fails(&["agent"], &[("DRAY_ADMIN_LISTEN", "9464")]);
    assert!(
        err.contains("invalid value '9464' for '--admin-listen"),
        "{err}"
    );
    let err = fails(&["tracker"], &[("DRAY_LOG_FORMAT", "yaml")]);
    assert!(
        err.contains("invalid value 'yaml' for '--log-format"),
        "{err}"
    );
    let err = fails(&["--log", "dray=loud", "tracker"], &[]);
    assert!(
        err.contains("invalid value 'dray=loud' for '--log <FILTER>'"),
        "{err}"
    );
}
