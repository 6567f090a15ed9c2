//! The Kraken-like baseline's random peer graph.

use super::*;

/// Each node links to `degree / 2` random others (undirected, so about
/// `degree` neighbours each); each blob's origin links to `degree` random
/// nodes and starts pulling its blob from the registry.
pub(super) fn build_kraken_graph(w: &mut World, origins: u32) {
    let n = w.pullers as usize;
    let half = (w.sc.kraken_degree / 2).max(1) as usize;
    for b in 0..w.blobs.len() {
        if n > 1 {
            for i in 0..n {
                for _ in 0..half {
                    let j = w.rng.below(n);
                    if j == i || w.nodes[i].blobs[b].peers.contains(&(j as u32)) {
                        continue;
                    }
                    w.add_peer(i as u32, b, j as u32);
                    w.add_peer(j as u32, b, i as u32);
                }
            }
        }
        if (b as u32) < origins {
            let origin = w.pullers + b as u32;
            for _ in 0..w.sc.kraken_degree {
                let j = w.rng.below(n);
                if !w.nodes[j].blobs[b].peers.contains(&origin) {
                    w.add_peer(j as u32, b, origin);
                }
            }
            // The origin holds only its own blob; the others count as done so it never pulls them.
            let o = origin as usize;
            for (k, nb) in w.nodes[o].blobs.iter_mut().enumerate() {
                nb.picker = None;
                nb.complete = k != b;
            }
            w.nodes[o].started = true;
            // Not a puller: never polls, never counts as pending.
            w.nodes[o].done_at = Some(0.0);
            let bytes = w.blobs[b].bytes as f64;
            let payload = Payload::new(origin, Source::Registry, b as u16, 0, Purpose::Whole);
            w.start_flow(payload, bytes);
        }
    }
}
