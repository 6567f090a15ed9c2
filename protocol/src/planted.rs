//! Deliberately broken rules, to show that `dray sim --chaos` catches bugs
//! (issue 36: a sweep that passes with a broken rule is itself the bug).
//! Each is compiled in only with the `planted` feature (the test builds'
//! `dray/hostile` turns it on) and is off until [`plant`] turns it on for
//! the process, as `dray sim --chaos --plant NAME` does; release builds
//! have none of them, and [`is`] is a constant `false` there.

/// A broken rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bug {
    /// The tracker-silence rule never fires: a pull waits out a hung or
    /// unreachable tracker until the stall rule.
    SilenceIgnored,
    /// The starvation rule as first written: it also takes chunks nobody
    /// has published (the bug the simulator found in it), and fires for a
    /// pull that dropped no peer.
    StarveUnpublished,
    /// The scheduler never takes back a run past its deadline, so a crashed
    /// fetcher's chunks wait until its announces expire.
    LateRunsKept,
    /// A chunk from a peer is taken whatever its bytes hash to.
    HashUnchecked,
    /// A registry server error is not retried: the request fails at once.
    NoRetry,
    /// A chunk request is waited for forever: a frozen peer (its
    /// connections open, no answers) holds the chunks asked of it.
    NoDeadline,
}

impl Bug {
    pub const ALL: [Bug; 6] = [
        Bug::SilenceIgnored,
        Bug::StarveUnpublished,
        Bug::LateRunsKept,
        Bug::HashUnchecked,
        Bug::NoRetry,
        Bug::NoDeadline,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Bug::SilenceIgnored => "silence-ignored",
            Bug::StarveUnpublished => "starve-unpublished",
            Bug::LateRunsKept => "late-runs-kept",
            Bug::HashUnchecked => "hash-unchecked",
            Bug::NoRetry => "no-retry",
            Bug::NoDeadline => "no-deadline",
        }
    }

    /// The bug of that name.
    pub fn named(name: &str) -> Option<Bug> {
        Bug::ALL.into_iter().find(|b| b.name() == name)
    }
}

#[cfg(feature = "planted")]
static PLANTED: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Turns `bug` on for this process; false if this build has no planted
/// bugs (built without the `planted` feature).
pub fn plant(bug: Bug) -> bool {
    #[cfg(feature = "planted")]
    {
        PLANTED.store(bug as u8 + 1, std::sync::atomic::Ordering::Relaxed);
        true
    }
    #[cfg(not(feature = "planted"))]
    {
        let _ = bug;
        false
    }
}

/// Whether `bug` is on.
#[inline]
pub fn is(bug: Bug) -> bool {
    #[cfg(feature = "planted")]
    {
        PLANTED.load(std::sync::atomic::Ordering::Relaxed) == bug as u8 + 1
    }
    #[cfg(not(feature = "planted"))]
    {
        let _ = bug;
        false
    }
}
