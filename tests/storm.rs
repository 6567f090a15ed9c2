//! The simulator against the emulation: `dray bench storm` on a small emulated
//! cluster (network namespaces, tbf-capped links, real registry, tracker and
//! agents) must finish where the simulator, given the same cluster
//! (`Scenario::emulated`), says it will. Needs root; about 40 s.

use std::process::Command;

/// How far the simulator's p50 and last-node times may be from the emulation's.
const TOLERANCE: f64 = 0.20;

#[test]
#[ignore = "fails today, 17-25% off: the simulator (which models hash publication, \
            the peers' news and BUSY back-offs) predicts p50 and last 6.03 s where 4 emulated \
            nodes took p50 7.26-7.77 s and last 7.36-8.00 s; what it lacks are request round \
            trips, TCP/QUIC dynamics and the agents' CPU; run with --ignored as root"]
fn the_simulator_predicts_the_emulated_storm_within_20_percent() {
    let out = Command::new(env!("CARGO_BIN_EXE_dray"))
        .args([
            "bench", "storm", "--nodes", "4", "--size", "64MiB", "--json",
        ])
        .output()
        .expect("running dray bench storm");
    assert!(
        out.status.success(),
        "dray bench storm failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let r: serde_json::Value = text
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON result in the bench output: {text}"));
    let get = |key: &str| {
        r[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing from {r}"))
    };
    // The swarm itself works: every chunk left the registry about once.
    assert!(get("registry_copies") < 1.05, "{r}");
    for (emulated, predicted) in [
        ("swarm_p50_s", "predicted_p50_s"),
        ("swarm_last_s", "predicted_last_s"),
    ] {
        let (e, p) = (get(emulated), get(predicted));
        assert!(
            (p - e).abs() <= TOLERANCE * e,
            "{predicted} = {p:.2} s is more than {:.0}% from {emulated} = {e:.2} s: {r}",
            TOLERANCE * 100.0
        );
    }
}
