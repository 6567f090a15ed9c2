//! Runs a named scenario and prints the reports as JSON lines:
//! `cargo run --release -p dray-simulations --example storm -- storm-10k [strategy...]`.

use dray_simulations::{Strategy, run, scenario};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_else(|| "small".to_owned());
    let sc = scenario(&name)?;
    let strategies: Vec<Strategy> = args.map(|a| a.parse()).collect::<Result<_, _>>()?;
    let strategies = if strategies.is_empty() {
        vec![Strategy::Dray]
    } else {
        strategies
    };
    for strategy in strategies {
        let mut r = run(&sc, strategy, 1)?;
        r.completion_cdf.clear();
        r.registry_egress.clear();
        println!("{}", serde_json::to_string(&r)?);
    }
    Ok(())
}
