//! Prints each seed's outcome of a chaos sweep as a line of JSON (its fault
//! classes, egress, the bound it was checked against, times, violations):
//! what `docs/results.md`'s per-class tables are computed from.
//!
//! `cargo run -p dray-simulations --release --example chaos_seeds -- [SEEDS] [PLANT]`
//! (seeds 1..=SEEDS, 1000 by default); `PLANT` names a planted bug and needs
//! `--features dray-protocol/planted`.

use dray_protocol::planted::{self, Bug};

fn main() {
    let mut args = std::env::args().skip(1);
    let seeds: u64 = args.next().map_or(1000, |s| s.parse().expect("SEEDS"));
    if let Some(name) = args.next() {
        let bug = Bug::named(&name).expect("a planted bug's name");
        assert!(planted::plant(bug), "built without dray-protocol/planted");
    }
    for seed in 1..=seeds {
        let o = dray_simulations::chaos::check(seed).expect("a valid case");
        println!("{}", serde_json::to_string(&o).expect("an outcome as JSON"));
    }
}
