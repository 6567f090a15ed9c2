//! The liars of `dray bench swarm --hostile K`, built only with the `hostile`
//! cargo feature (release builds leave it out). Each is a cluster member
//! with a valid certificate that speaks the real protocol to the real
//! tracker and peer plane, and lies in one way:
//!
//! - a **flipper** holds every chunk of the blob but the last (its store
//!   would check the blob's digest on the last), each with one bit flipped,
//!   announces and serves them, and publishes the forgery's hashes at once;
//! - a **trickler** holds the whole blob and uploads 64 bytes a second;
//! - a **forger** publishes a fresh forged chunk map every 100 ms;
//! - an **accuser**, every 100 ms, says it wants the blob, accuses every peer
//!   the tracker names of sending it a bad chunk, claims to hold the whole
//!   blob and reports that it failed its digest;
//! - a **withholder** announces the whole blob and answers bitfields, and
//!   no chunk request (`bench::withholder`).
//!
//! The agent has no switch to misbehave: the liars are made of its public
//! parts (a store filled by hand, a tracker client, an upload cap, its QUIC
//! endpoint settings).

use crate::bench::withholder::Withholder;
use crate::bench::{SwarmRun, pull_all};
use anyhow::{Context, Result, bail};
use dray_agent::discovery::tracker_client::TrackerClient;
use dray_agent::peer::PeerConfig;
use dray_agent::pull::registry::RegistryClient;
use dray_agent::pull::swarm::SwarmConfig;
use dray_protocol::chunkmap::{ChunkMapBuilder, chunk_hash};
use dray_protocol::pb::{self, tracker_request::Body};
use dray_protocol::{BlobDigest, ChunkMap, DEFAULT_CHUNK_SIZE};
use dray_testkit::cluster::LocalCluster;
use serde::Serialize;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// One way to lie.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Attack {
    /// Serve every chunk with a bit flipped, under forged hashes.
    Flip,
    /// Serve the right chunks at 64 bytes a second.
    Trickle,
    /// Publish forged chunk maps.
    Forge,
    /// Report bad chunks and a digest failure about honest nodes.
    Accuse,
    /// Announce the whole blob and answer no chunk request.
    Withhold,
}

/// The bytes a second a trickler uploads.
const TRICKLE_BYTES_PER_S: u64 = 64;
/// How often forgers and accusers repeat their lies.
const LIE_EVERY: Duration = Duration::from_millis(100);
/// How long the liars keep lying at most, whatever the storm does.
const LIE_FOR: Duration = Duration::from_secs(600);

/// What the liars did to the honest nodes, beside the same storm without them.
#[derive(Serialize)]
pub struct HostileResult {
    /// The liars, and the attack each ran.
    pub liars: Vec<(String, Attack)>,
    /// Every honest node finished, holding the blob byte-identical (its
    /// digest recomputed here from the file).
    pub honest_complete: bool,
    /// Honest pulls that failed, with their errors.
    pub honest_failures: Vec<String>,
    /// Bytes an honest node held as verified and had to throw away as wrong
    /// (and may have served): must be 0.
    pub corrupt_bytes: u64,
    /// Chunk hashes the tracker hands out that are not the blob's: must be 0.
    pub forged_hashes: usize,
    pub egress_ratio: f64,
    /// The last honest node, beside the liars.
    pub swarm_last_s: f64,
    pub swarm_p50_s: f64,
    /// The last node of the same storm without liars.
    pub clean_last_s: f64,
    /// swarm_last_s / clean_last_s: what the liars cost in time.
    pub last_ratio: f64,
    /// Honest nodes that fell back to the registry for unclaimed chunks.
    pub fell_back: usize,
    /// Honest nodes the tracker banned: must be 0.
    pub honest_banned: usize,
    /// The liars the tracker banned.
    pub liars_banned: Vec<String>,
    /// Honest nodes an asker reported silent (a request left unanswered).
    pub honest_reported_silent: usize,
    /// The liars askers reported silent.
    pub liars_reported_silent: Vec<String>,
    /// Peers honest nodes dropped as slow or for bad chunks, summed.
    pub slow_peers_dropped: usize,
    pub bad_peers_dropped: usize,
    /// The accusers' bad-chunk reports the tracker took, and its last refusal.
    pub accusations_taken: u64,
    pub last_refusal: Option<String>,
}

/// The storm of `clean` again, in a new cluster under `root`, with `count`
/// liars (taking `attacks` in turn) joining before the honest nodes pull.
#[allow(clippy::too_many_arguments)]
pub async fn storm(
    root: &Path,
    nodes: usize,
    count: usize,
    attacks: &[Attack],
    registry: &dray_testkit::testbed::Registry,
    client: &Arc<RegistryClient>,
    digest: BlobDigest,
    clean: &SwarmRun,
) -> Result<HostileResult> {
    if attacks.is_empty() {
        bail!("--attacks names no attack");
    }
    let blob = registry.blob_file(&digest.to_string());
    let real = real_map(&blob, digest)?;
    let mut cluster =
        LocalCluster::start(root, nodes, SwarmConfig::default(), &Default::default()).await?;
    let liars: Vec<(String, Attack)> = (0..count)
        .map(|i| {
            let attack = attacks[i % attacks.len()];
            (format!("{attack:?}-{i}").to_lowercase(), attack)
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    let mut withholders = Vec::new();
    let mut holders = 0;
    for (id, attack) in &liars {
        let dir = root.join(id);
        match attack {
            Attack::Flip | Attack::Trickle => {
                let peer = PeerConfig {
                    upload_bytes_per_s: (*attack == Attack::Trickle).then_some(TRICKLE_BYTES_PER_S),
                    ..PeerConfig::default()
                };
                let swarm = cluster.join(id, &dir, SwarmConfig::default(), peer, None)?;
                let store = swarm.node().store();
                if *attack == Attack::Trickle {
                    store.import(&blob, DEFAULT_CHUNK_SIZE)?;
                } else {
                    let lie = flip_every_chunk(store, &blob, &real)?;
                    let tracker =
                        TrackerClient::new(vec![cluster.tracker.url()], swarm.node().identity());
                    let publish = Body::Publish(pb::PublishChunkMap {
                        peer_id: id.clone(),
                        map: Some(lie.to_pb()),
                    });
                    // Refused or held as unconfirmed: either way, it tried.
                    _ = tracker.send(&cluster.tracker.url(), publish).await;
                }
                holders += 1;
            }
            Attack::Withhold => {
                let w = Withholder::bind(cluster.ca.issue(id)?, real.clone())?;
                let run = w.run(cluster.tracker.url(), stop.clone(), LIE_FOR);
                withholders.push(tokio::spawn(run));
                holders += 1;
            }
            Attack::Forge | Attack::Accuse => {
                let speaker = Speaker {
                    tracker: TrackerClient::new(
                        vec![cluster.tracker.url()],
                        &cluster.ca.issue(id)?,
                    ),
                    url: cluster.tracker.url(),
                    id: id.clone(),
                    map: real.clone(),
                };
                tasks.push(tokio::spawn(speaker.lie(*attack, stop.clone())));
            }
        }
    }
    // The storm starts once the tracker counts every holding liar among the
    // holders of a chunk each holds (the flippers' last is missing).
    let probe = real.chunk_count().saturating_sub(2);
    let started = Instant::now();
    while cluster.tracker.tracker.holders(&digest, probe) < holders {
        if started.elapsed() > Duration::from_secs(30) {
            bail!("the tracker heard of {holders} liars holding the blob within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let run = pull_all(&cluster, registry, client, digest).await?;
    stop.store(true, Ordering::Relaxed);
    let tally = finish(tasks).await?;
    for w in withholders {
        w.await.context("a withholder's task")?;
    }
    let standing = |id: &str| cluster.tracker.tracker.standing(id);

    let mut complete = run.failures.is_empty();
    for swarm in &cluster.agents {
        let held = swarm.node().store().get(&digest)?;
        complete &= held
            .is_some_and(|b| dray_testkit::testbed::file_digest(b.path()) == digest.to_string());
    }
    let forged_hashes = cluster.tracker.tracker.map(&digest).map_or(0, |m| {
        m.hashes()
            .iter()
            .zip(real.hashes())
            .filter(|(h, r)| h.is_some() && h != r)
            .count()
    });
    let median = |t: &[f64]| t.get(t.len() / 2).copied().unwrap_or(f64::NAN);
    let last = |t: &[f64]| t.last().copied().unwrap_or(f64::NAN);
    let clean_last = last(&clean.times);
    Ok(HostileResult {
        honest_complete: complete,
        honest_failures: run.failures.clone(),
        corrupt_bytes: run.reports.iter().map(|r| r.discarded_bytes).sum(),
        forged_hashes,
        egress_ratio: run.egress as f64 / real.size() as f64,
        swarm_last_s: last(&run.times),
        swarm_p50_s: median(&run.times),
        clean_last_s: clean_last,
        last_ratio: last(&run.times) / clean_last,
        fell_back: run.reports.iter().filter(|r| r.fell_back).count(),
        honest_banned: (0..nodes)
            .filter(|&i| standing(&LocalCluster::node_id(i)).banned)
            .count(),
        liars_banned: liars
            .iter()
            .map(|(id, _)| id.clone())
            .filter(|id| standing(id).banned)
            .collect(),
        honest_reported_silent: (0..nodes)
            .filter(|&i| standing(&LocalCluster::node_id(i)).silent_reporters > 0)
            .count(),
        liars_reported_silent: liars
            .iter()
            .map(|(id, _)| id.clone())
            .filter(|id| standing(id).silent_reporters > 0)
            .collect(),
        slow_peers_dropped: run.reports.iter().map(|r| r.slow_peers.len()).sum(),
        bad_peers_dropped: run.reports.iter().map(|r| r.bad_peers.len()).sum(),
        accusations_taken: tally.accepted,
        last_refusal: tally.last_refusal,
        liars,
    })
}

/// The blob's real chunk map, read from `blob`.
pub(crate) fn real_map(blob: &Path, digest: BlobDigest) -> Result<ChunkMap> {
    let mut builder = ChunkMapBuilder::new(DEFAULT_CHUNK_SIZE);
    each_chunk(blob, |_, bytes| {
        builder.update(bytes);
        Ok(())
    })?;
    Ok(builder.finish(Some(digest))?)
}

/// Calls `f` with each chunk of the file at `path`, in order.
fn each_chunk(path: &Path, mut f: impl FnMut(u32, &[u8]) -> Result<()>) -> Result<()> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut buf = vec![0; DEFAULT_CHUNK_SIZE as usize];
    for index in 0.. {
        let mut len = 0;
        while len < buf.len() {
            match file.read(&mut buf[len..])? {
                0 => break,
                n => len += n,
            }
        }
        if len == 0 {
            return Ok(());
        }
        f(index, &buf[..len])?;
    }
    Ok(())
}

/// Flips one bit of every chunk of `blob`, stores all but the last in
/// `store` under the forgery's map, and returns that map.
pub(crate) fn flip_every_chunk(
    store: &dray_agent::store::ChunkStore,
    blob: &Path,
    real: &ChunkMap,
) -> Result<ChunkMap> {
    let flip = |bytes: &[u8]| {
        let mut b = bytes.to_vec();
        b[bytes.len() / 2] ^= 0x40;
        b
    };
    let mut hashes = Vec::new();
    each_chunk(blob, |_, bytes| {
        hashes.push(chunk_hash(&flip(bytes)));
        Ok(())
    })?;
    let lie = ChunkMap::new(real.digest(), real.size(), real.chunk_size(), hashes)?;
    let held = store.blob(&lie)?;
    each_chunk(blob, |i, bytes| {
        if i + 1 < lie.chunk_count() {
            held.put_chunk(i, &flip(bytes))?;
        }
        Ok(())
    })?;
    Ok(lie)
}

/// What forgers and accusers got the tracker to take.
#[derive(Default)]
struct Tally {
    /// Bad-chunk reports taken.
    accepted: u64,
    last_refusal: Option<String>,
}

async fn finish(tasks: Vec<JoinHandle<Tally>>) -> Result<Tally> {
    let mut all = Tally::default();
    for t in tasks {
        let t = t.await.context("a liar's task")?;
        all.accepted += t.accepted;
        all.last_refusal = t.last_refusal.or(all.last_refusal);
    }
    Ok(all)
}

/// A forger or an accuser: a certificate holder that only talks to the tracker.
struct Speaker {
    tracker: TrackerClient,
    url: String,
    id: String,
    /// The real map of the blob it lies about.
    map: ChunkMap,
}

impl Speaker {
    /// Runs one round of `attack` every [`LIE_EVERY`] until `stop`.
    async fn lie(self, attack: Attack, stop: Arc<AtomicBool>) -> Tally {
        let mut tally = Tally::default();
        let started = Instant::now();
        let mut round = 0u8;
        while !stop.load(Ordering::Relaxed) && started.elapsed() < LIE_FOR {
            round = round.wrapping_add(1);
            match attack {
                Attack::Forge => self.forge(round, &mut tally).await,
                _ => self.accuse(&mut tally).await,
            }
            tokio::time::sleep(LIE_EVERY).await;
        }
        tally
    }

    /// Publishes a forged map of the blob, different each round.
    async fn forge(&self, round: u8, tally: &mut Tally) {
        let map = &self.map;
        let hashes = (0..map.chunk_count())
            .map(|i| [round ^ i as u8; 32])
            .collect();
        let Ok(forged) = ChunkMap::new(map.digest(), map.size(), map.chunk_size(), hashes) else {
            return;
        };
        let publish = Body::Publish(pb::PublishChunkMap {
            peer_id: self.id.clone(),
            map: Some(forged.to_pb()),
        });
        if let Err(e) = self.tracker.send(&self.url, publish).await {
            tally.last_refusal = Some(e.0);
        }
    }

    /// Wants the blob, accuses every peer the tracker names, claims the
    /// whole blob and reports that it failed its digest.
    async fn accuse(&self, tally: &mut Tally) {
        let (map, id) = (&self.map, &self.id);
        let bytes = map.chunk_count().div_ceil(8) as usize;
        let announce = |bits: Vec<u8>| {
            Body::Announce(pb::Announce {
                peer_id: id.clone(),
                address: "127.0.0.1:9".into(),
                full: true,
                blobs: vec![pb::BlobHolding {
                    digest: map.digest().to_string(),
                    size: map.size(),
                    chunk_size: map.chunk_size(),
                    bits: bits.into(),
                    wanted: true,
                    ..Default::default()
                }],
                ..Default::default()
            })
        };
        if let Ok(Some(answer)) = self.tracker.send(&self.url, announce(vec![0; bytes])).await {
            for named in answer.peers.values().flat_map(|l| &l.peers) {
                let report = Body::BadChunk(pb::BadChunkReport {
                    reporter: id.clone(),
                    offender: named.peer_id.clone(),
                    digest: map.digest().to_string(),
                    index: 0,
                });
                match self.tracker.send(&self.url, report).await {
                    Ok(_) => tally.accepted += 1,
                    Err(e) => tally.last_refusal = Some(e.0),
                }
            }
        }
        _ = self
            .tracker
            .send(&self.url, announce(vec![0xff; bytes]))
            .await;
        let failed = Body::DigestFailed(pb::BlobDigestFailed {
            reporter: id.clone(),
            digest: map.digest().to_string(),
        });
        _ = self.tracker.send(&self.url, failed).await;
    }
}

/// The table lines of a hostile run.
pub fn print(h: &HostileResult) {
    let liars: Vec<String> = h.liars.iter().map(|(id, _)| id.clone()).collect();
    println!("beside {} liars ({}):", liars.len(), liars.join(", "));
    println!(
        "swarm, liars {:11.3} {:7.2} {:8.2}   (clean last {:.2} s: {:.2}x)",
        h.egress_ratio, h.swarm_p50_s, h.swarm_last_s, h.clean_last_s, h.last_ratio
    );
    println!(
        "honest nodes complete and intact: {}   corrupt bytes: {}   forged hashes handed out: {}",
        h.honest_complete, h.corrupt_bytes, h.forged_hashes
    );
    println!(
        "honest nodes banned: {}   liars banned: {:?}   honest nodes reported silent: {}   liars reported silent: {:?}",
        h.honest_banned, h.liars_banned, h.honest_reported_silent, h.liars_reported_silent
    );
    println!(
        "accusations taken: {}   peers dropped as slow: {}, for bad chunks: {}   fell back: {}",
        h.accusations_taken, h.slow_peers_dropped, h.bad_peers_dropped, h.fell_back
    );
    for f in &h.honest_failures {
        println!("failed: {f}");
    }
}
