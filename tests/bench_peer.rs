//! Issue 20: `dray bench peer` measures a sending and a receiving agent as two
//! processes, beside plain TCP, TCP with rustls and a bare quinn stream, and
//! the cost of writing the same bytes to a file. A specification of the
//! report's shape, not a timed test: the figures depend on the machine.

mod common;

use common::dray_ok;

#[test]
fn bench_peer_reports_each_sides_cpu_and_every_baseline_in_one_json_object() {
    let out = dray_ok(&[
        "bench", "peer", "--size", "64MiB", "--only", "timed", "--rounds", "1", "--json",
    ]);
    let r: serde_json::Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("dray bench peer printed no JSON ({e}): {out}"));
    for field in [
        "agent_mb_s",
        "tcp_mb_s",
        "tls_tcp_mb_s",
        "tls_tcp_to_disk_mb_s",
        "tls_tcp_to_disk_receiver_cpu_s_per_gib",
        "raw_quic_mb_s",
        "sender_cpu_s_per_gib",
        "receiver_cpu_s_per_gib",
        "tcp_receiver_cpu_s_per_gib",
        "tls_tcp_sender_cpu_s_per_gib",
        "raw_quic_sender_cpu_s_per_gib",
        "receiver_peak_rss_mib",
        "sender_peak_rss_mib",
    ] {
        let v = r[field]
            .as_f64()
            .unwrap_or_else(|| panic!("{field} missing in {out}"));
        assert!(v > 0.0, "{field} is {v} in {out}");
    }
    let (peak, before) = (
        r["receiver_peak_rss_mib"].as_f64().unwrap(),
        r["receiver_rss_before_mib"].as_f64().unwrap(),
    );
    assert!(before > 0.0 && before <= peak, "{out}");
    // Page-cache writes may cost less than a clock tick at this size.
    assert!(r["write_floor_cpu_s_per_gib"].as_f64().unwrap() >= 0.0);
    // The agents verified the blob over loopback, whose MTU is 64K.
    assert!(r["path_mtu"].as_u64().unwrap() > 1500, "{out}");
    assert_eq!(r["size_bytes"], 64 << 20);
}

/// Issue 40: the agent's user-space instructions per GiB, both sides summed,
/// against raw quinn's on an endpoint made as the agent's is (the same
/// transport settings and UDP socket), counted under cachegrind (a count,
/// not a time, so stable enough for a test). The two must move the blob in
/// about as many datagrams: the baseline once ran on quinn's defaults (a
/// 1452-byte MTU bound, five times the agent's datagrams on loopback), which
/// made the agent look 0.72x quinn's cost; on the same endpoint it is 1.45x
/// on loopback and 1.19x on a veth pair (`docs/results.md`), so the issue's
/// 1.2x goal is not met, and this is a regression guard at 2x: a per-byte
/// copy of each received chunk, planted, added 1.56e10 instructions per GiB
/// (about 3.4x on this baseline). The blob digest's
/// SHA-256 is left out of the comparison: valgrind does not emulate the SHA
/// extensions, so it counts `sha2`'s software rounds (about 55 instructions
/// a byte) where the agent natively runs SHA-NI's; it is reported apart and
/// checked to be the receiver's alone. Each path's second and third unit
/// disagree by a few percent on an idle machine and by up to 25.6% on a CI
/// machine (a path's timers fire more or less often under cachegrind's
/// slowdown), so the bound is checked at the unfavourable end of both
/// spreads; a spread past 50% means the method is broken (before
/// valgrind's fair scheduling a spin counted wall time, see
/// `src/bench/peer_counted.rs`).
#[test]
fn agent_instructions_per_gib_stay_within_2x_of_raw_quinn_on_the_same_endpoint() {
    let out = dray_ok(&[
        "bench",
        "peer",
        "--only",
        "counted",
        "--counted-size",
        "8MiB",
        "--json",
    ]);
    let r: serde_json::Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("dray bench peer printed no JSON ({e}): {out}"));
    let both = |path: &str| -> f64 {
        ["sender", "receiver"]
            .iter()
            .map(|side| {
                r[format!("{path}_instructions_per_gib_{side}")]
                    .as_f64()
                    .unwrap_or_else(|| panic!("no {path} {side} instructions in {out}"))
            })
            .sum()
    };
    let digest = r["agent_digest_instructions_per_gib_receiver"]
        .as_f64()
        .unwrap();
    assert!(digest > 0.0, "the receiver checks the blob digest: {out}");
    assert_eq!(r["agent_digest_instructions_per_gib_sender"], 0.0, "{out}");
    let (agent, quinn) = (both("agent") - digest, both("quinn"));
    assert!(quinn > 0.0, "{out}");
    let spread = |path: &str| {
        r[format!("{path}_instructions_disagreement_pct")]
            .as_f64()
            .unwrap_or_else(|| panic!("no {path} disagreement in {out}"))
    };
    let (agent_spread, quinn_spread) = (spread("agent"), spread("quinn"));
    // A method whose units disagree this much counts something other than
    // bytes moved (the spin that grew with wall time did).
    assert!(
        agent_spread <= 50.0 && quinn_spread <= 50.0,
        "the units' counts disagree: {out}"
    );
    // The claim holds at the unfavourable end of each path's spread: the
    // agent's larger unit against quinn's smaller.
    let (agent_high, quinn_low) = (
        agent * (1.0 + agent_spread / 200.0),
        quinn * (1.0 - quinn_spread / 200.0),
    );
    assert!(
        agent_high <= 2.0 * quinn_low,
        "agent up to {agent_high:.3e} (without the digest) against quinn from {quinn_low:.3e}: {out}"
    );
    assert!(r["agent_syscalls_per_gib"].as_f64().unwrap() > 0.0, "{out}");
    // The same endpoint sends about as many datagrams either way: a
    // baseline on other settings (quinn's 1452-byte MTU bound) sent five
    // times the agent's, and counted five times its per-packet work.
    let datagrams = |path: &str| r[format!("{path}_datagrams_per_gib")].as_f64().unwrap();
    let (agent_dgrams, quinn_dgrams) = (datagrams("agent"), datagrams("quinn"));
    assert!(quinn_dgrams > 0.0, "{out}");
    assert!(
        (agent_dgrams - quinn_dgrams).abs() <= 0.25 * quinn_dgrams,
        "agent {agent_dgrams} against quinn {quinn_dgrams} datagrams per GiB: not the same transport: {out}"
    );
    assert_eq!(r["net"], "loopback", "{out}");
}
