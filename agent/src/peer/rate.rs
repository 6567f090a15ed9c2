//! Byte-rate limits for uploads and downloads (governor), off unless configured.

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use std::num::NonZeroU32;

/// Bytes per governor cell: a cell per KiB keeps any realistic rate in a u32.
const CELL: u64 = 1024;

/// A shared bytes-per-second budget.
pub struct ByteRate {
    limiter: Option<(DefaultDirectRateLimiter, NonZeroU32)>,
}

impl ByteRate {
    /// `None` or zero means unlimited.
    pub fn new(bytes_per_s: Option<u64>) -> Self {
        let limiter = bytes_per_s.filter(|&r| r > 0).map(|rate| {
            let per_s = NonZeroU32::new((rate / CELL).clamp(1, u64::from(u32::MAX)) as u32)
                .expect("clamped to >= 1");
            // Burst of a tenth of a second, at least 64 KiB, so pacing is smooth.
            let burst = NonZeroU32::new((per_s.get() / 10).max(64)).expect(">= 64");
            (
                RateLimiter::direct(Quota::per_second(per_s).allow_burst(burst)),
                burst,
            )
        });
        Self { limiter }
    }

    /// Waits until `bytes` may pass.
    pub async fn take(&self, bytes: usize) {
        let Some((limiter, burst)) = &self.limiter else {
            return;
        };
        let mut cells = (bytes as u64).div_ceil(CELL);
        while cells > 0 {
            let n = cells.min(u64::from(burst.get())) as u32;
            limiter
                .until_n_ready(NonZeroU32::new(n).expect("n >= 1"))
                .await
                .expect("n never exceeds the burst");
            cells -= u64::from(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn paces_bytes_to_the_configured_rate() {
        let rate = ByteRate::new(Some(4 << 20));
        let start = std::time::Instant::now();
        for _ in 0..8 {
            rate.take(1 << 20).await;
        }
        // 8 MiB at 4 MiB/s, less the initial burst of 0.4 MiB: close to 1.9 s.
        let s = start.elapsed().as_secs_f64();
        assert!((1.6..3.0).contains(&s), "took {s} s");
        let free = ByteRate::new(None);
        let start = std::time::Instant::now();
        free.take(1 << 30).await;
        assert!(start.elapsed().as_millis() < 50);
    }
}
