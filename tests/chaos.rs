//! Issue 36: `dray sim --chaos` sweeps 200 seeded fault cases over storms of
//! simulated nodes that run the agent's pull machine and the tracker's
//! scheduler, with every invariant holding on every seed; and each of six
//! deliberately broken rules (`dray_protocol::planted`, in this test build)
//! makes the same sweep report a failing seed, whose printed command
//! reproduces the same failure. Each sweep runs the `dray` binary, so a
//! planted bug stays inside its own process.

use serde_json::Value;
use std::process::{Command, Output};

fn dray(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dray"))
        .args(args)
        .output()
        .expect("dray runs")
}

/// The sweep's JSON report, and whether it exited 0.
fn sweep(args: &[&str]) -> (Value, bool) {
    let mut all = vec!["sim", "--chaos", "--json"];
    all.extend_from_slice(args);
    let out = dray(&all);
    let text = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("{e}: {text}\n{}", String::from_utf8_lossy(&out.stderr)));
    (report, out.status.success())
}

#[test]
fn two_hundred_seeds_of_faults_keep_every_invariant() {
    let (r, ok) = sweep(&["--seeds", "200"]);
    assert_eq!(r["seeds"], 200);
    assert_eq!(r["failed"], 0, "{:#}", r["failures"]);
    assert!(ok);
    let classes: Vec<&str> = r["fault_classes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    for class in [
        "tracker-hang",
        "tracker-crash",
        "tracker-partition",
        "registry-slow",
        "peer-crash",
        "late-join",
        "liars",
        "peer-freeze",
        "registry-errors",
        "withholders",
        "accusers",
        "tricklers",
        "claimers",
    ] {
        assert!(classes.contains(&class), "{classes:?}");
    }
    for c in r["classes"].as_array().unwrap() {
        assert!(c["seeds"].as_u64().unwrap() > 0, "every class drawn: {c}");
        let egress = c["max_egress_copies"].as_f64().unwrap();
        let time = c["max_time_ratio"].as_f64().unwrap();
        assert!(egress >= 1.0 && time > 0.0, "{c}");
    }
    assert!(r["events_per_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn each_planted_bug_makes_the_sweep_fail_and_its_seed_reproduces_it() {
    for bug in [
        "silence-ignored",
        "starve-unpublished",
        "late-runs-kept",
        "hash-unchecked",
        "no-retry",
        "no-deadline",
    ] {
        let (r, ok) = sweep(&["--seeds", "200", "--plant", bug]);
        assert!(!ok, "{bug}: the sweep passed with a broken rule");
        assert!(r["failed"].as_u64().unwrap() > 0, "{bug}");
        assert_eq!(r["planted"], bug);
        let first = &r["failures"][0];
        let line = first["reproduce"].as_str().unwrap();
        let args: Vec<&str> = line.split_whitespace().skip(1).collect();
        assert_eq!(args[..2], ["sim", "--chaos"], "{line}");
        let mut again = args.clone();
        again.push("--json");
        let out = dray(&again);
        assert!(!out.status.success(), "{line}");
        let again: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(again["failed"], 1, "{line}");
        // The same events in the same order: the same outcome exactly.
        let (a, b) = (&again["failures"][0], first);
        for field in ["seed", "violations", "egress_copies", "max_s", "events"] {
            assert_eq!(a[field], b[field], "{bug}: {field} of {line}");
        }
    }
}

#[test]
fn a_build_without_the_bug_named_is_refused_with_the_known_names() {
    let out = dray(&["sim", "--chaos", "--plant", "no-such-bug"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no planted bug \"no-such-bug\"") && err.contains("late-runs-kept"),
        "{err}"
    );
}
