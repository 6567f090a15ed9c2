//! Prints the withholder, accuser, trickler and claimer tables of
//! `docs/results.md`: the `small` scenario (one 1 GiB layer) at 16 and 64
//! nodes with none, about 5% and a quarter of the nodes withholding
//! (announcing chunks, serving none), accusing (reporting every peer named
//! to them silent), trickling (serving every chunk at 1 KiB/s) or claiming
//! (announcing every chunk from the start, serving none), seeds 1-3, as
//! lines of JSON.
//!
//! `cargo run -p dray-simulations --release --example adversaries`

use dray_simulations::{Strategy, run, scenario};

fn main() {
    for kind in ["withholders", "accusers", "tricklers", "claimers"] {
        for nodes in [16u32, 64] {
            for fraction in [0.0, 0.05, 0.25] {
                for seed in 1..=3 {
                    let mut sc = scenario("small").expect("the small scenario");
                    sc.nodes = nodes;
                    let share = (fraction > 0.0).then_some(fraction);
                    match kind {
                        "withholders" => sc.withholders = share,
                        "accusers" => sc.accusers = share,
                        "tricklers" => sc.tricklers = share,
                        _ => sc.claimers = share,
                    }
                    let r = run(&sc, Strategy::Dray, seed).expect("a valid scenario");
                    let a = &r.adversity;
                    let line = serde_json::json!({
                        "kind": kind,
                        "nodes": nodes,
                        "adversaries": a.withholders + a.accusers + a.tricklers + a.claimers,
                        "seed": seed,
                        "completed": r.completed,
                        "last_s": r.max_s,
                        "egress_copies": r.registry_egress_ratio,
                        "fallbacks": r.fallback_rules,
                        "dropped": a.frozen_dropped,
                    });
                    println!("{line}");
                }
            }
        }
    }
}
