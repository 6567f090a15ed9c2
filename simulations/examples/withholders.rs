//! Prints the withholder table of `docs/results.md`: the `small` scenario
//! (one 1 GiB layer) at 16 and 64 nodes, with no withholder, about 5% and
//! a quarter of the nodes withholding, seeds 1-3, as lines of JSON.
//!
//! `cargo run -p dray-simulations --release --example withholders`

use dray_simulations::{Strategy, run, scenario};

fn main() {
    for nodes in [16u32, 64] {
        for fraction in [0.0, 0.05, 0.25] {
            for seed in 1..=3 {
                let mut sc = scenario("small").expect("the small scenario");
                sc.nodes = nodes;
                sc.withholders = (fraction > 0.0).then_some(fraction);
                let r = run(&sc, Strategy::Dray, seed).expect("a valid scenario");
                let line = serde_json::json!({
                    "nodes": nodes,
                    "withholders": r.adversity.withholders,
                    "seed": seed,
                    "completed": r.completed,
                    "last_s": r.max_s,
                    "egress_copies": r.registry_egress_ratio,
                    "starved": r.fallback_rules.starved,
                    "fallbacks": r.fallbacks,
                    "dropped": r.adversity.frozen_dropped,
                    "honest_dropped": r.adversity.honest_dropped,
                });
                println!("{line}");
            }
        }
    }
}
