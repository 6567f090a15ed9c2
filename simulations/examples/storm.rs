//! Runs `storm-10k` (or a cut of it to fewer nodes) with the `dray` strategy,
//! or a chaos sweep, and prints the report as JSON: the figures a change to
//! the simulator's speed is measured and checked against.
//!
//! `cargo run -p dray-simulations --release --example storm -- [NODES] [SEED]`
//! (`NODES` 10000 and `SEED` 1 by default; `storm-100k` for the 100,000-node
//! storm), or `-- --chaos SEEDS` for `dray sim --chaos --seeds SEEDS --json` (from seed 1).

use dray_simulations::{Strategy, chaos, run, scenario};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = match args.first().map(String::as_str) {
        Some("--chaos") => {
            let seeds = args.get(1).map_or(200, |s| s.parse().expect("SEEDS"));
            let r = chaos::sweep(1, seeds, None, |_| {}).expect("a chaos sweep");
            serde_json::to_string_pretty(&r)
        }
        first => {
            let mut sc = if first == Some("storm-100k") {
                scenario("storm-100k")
            } else {
                scenario("storm-10k")
            }
            .expect("a named storm");
            if let Some(nodes) = first.filter(|&f| f != "storm-100k") {
                sc.nodes = nodes.parse().expect("NODES");
            }
            let seed = args.get(1).map_or(1, |s| s.parse().expect("SEED"));
            let r = run(&sc, Strategy::Dray, seed).expect("a valid storm");
            serde_json::to_string_pretty(&r)
        }
    };
    println!("{}", json.expect("a report serializes"));
}
