//! The peer plane's UDP socket: quinn's own, kept within the kernel's limit of
//! 64 KiB per send and per coalesced receive.
//!
//! quinn batches up to ten datagrams of the path MTU into one GSO send. Past
//! 64 KiB in all (ten datagrams of a 9000-byte jumbo-frame path, or two of
//! loopback's 64K) the kernel refuses the whole batch with `EMSGSIZE`, which
//! quinn-udp drops silently, as a lost burst: on loopback at a 8972-byte path
//! MTU that halved throughput and cost the sender 4.2 CPU-s per GiB against
//! 2.6 with GSO off (`dray bench peer`). Here such a batch is sent as several
//! sends of at most 64 KiB each, so GSO keeps its gain on 1500-byte paths
//! (3.2 against 8-9 CPU-s per GiB without it) and costs nothing on larger ones.
//!
//! quinn also sizes its receive buffer as 32 slots of `max_udp_payload` times
//! the GRO segment count (64): 128 MiB at a 64 KiB payload, most of it touched
//! by the kernel and resident. A coalesced receive is at most 64 KiB, so the
//! segment count reported here gives each slot 64 KiB.

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// Most UDP payload bytes one send may carry: an IPv4 packet's 65,535 bytes
/// less its 20-byte IP and 8-byte UDP headers (IPv6 allows 20 more).
const MAX_SEND: usize = 65_507;

/// Most bytes the kernel coalesces into one GRO receive.
const MAX_COALESCED: usize = 65_535;

/// quinn's socket, with sends and receive buffers sized to the kernel's limits.
#[derive(Debug)]
pub struct KernelSizedUdp {
    inner: Arc<dyn AsyncUdpSocket>,
    receive_segments: usize,
}

impl KernelSizedUdp {
    /// Wraps `inner` for an endpoint whose datagrams are at most
    /// `max_udp_payload` bytes.
    pub fn wrap(inner: Arc<dyn AsyncUdpSocket>, max_udp_payload: u16) -> Arc<Self> {
        let payload = usize::from(max_udp_payload).max(1);
        let receive_segments = inner
            .max_receive_segments()
            .min(MAX_COALESCED.div_ceil(payload));
        Arc::new(Self {
            inner,
            receive_segments,
        })
    }
}

impl AsyncUdpSocket for KernelSizedUdp {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        let segment = match transmit.segment_size {
            Some(s) if transmit.contents.len() > MAX_SEND => s,
            _ => return self.inner.try_send(transmit),
        };
        let per_send = (MAX_SEND / segment).max(1) * segment;
        for (i, part) in transmit.contents.chunks(per_send).enumerate() {
            let sent = self.inner.try_send(&Transmit {
                destination: transmit.destination,
                ecn: transmit.ecn,
                contents: part,
                segment_size: (part.len() > segment).then_some(segment),
                src_ip: transmit.src_ip,
            });
            match sent {
                Ok(()) => {}
                // Nothing sent yet: quinn waits until writable and retries.
                Err(e) if i == 0 => return Err(e),
                // Part of the batch is out: the rest counts as lost on the path
                // and QUIC's loss recovery resends it, rather than resending
                // the part that went.
                Err(_) => return Ok(()),
            }
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.receive_segments
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records every send it is asked for.
    #[derive(Debug, Default)]
    struct Recorder {
        sends: std::sync::Mutex<Vec<(usize, Option<usize>)>>,
    }

    impl AsyncUdpSocket for Recorder {
        fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
            unreachable!("not polled in these tests")
        }
        fn try_send(&self, t: &Transmit) -> io::Result<()> {
            self.sends
                .lock()
                .unwrap()
                .push((t.contents.len(), t.segment_size));
            Ok(())
        }
        fn poll_recv(
            &self,
            _: &mut Context,
            _: &mut [IoSliceMut<'_>],
            _: &mut [RecvMeta],
        ) -> Poll<io::Result<usize>> {
            Poll::Pending
        }
        fn local_addr(&self) -> io::Result<SocketAddr> {
            Ok("127.0.0.1:1".parse().unwrap())
        }
        fn max_transmit_segments(&self) -> usize {
            10
        }
        fn max_receive_segments(&self) -> usize {
            64
        }
    }

    fn send(segment: usize, count: usize) -> Vec<(usize, Option<usize>)> {
        let rec = Arc::new(Recorder::default());
        let socket = KernelSizedUdp::wrap(rec.clone(), 65_527);
        let contents = vec![0u8; segment * count];
        socket
            .try_send(&Transmit {
                destination: "127.0.0.1:2".parse().unwrap(),
                ecn: None,
                contents: &contents,
                segment_size: (count > 1).then_some(segment),
                src_ip: None,
            })
            .unwrap();
        rec.sends.lock().unwrap().clone()
    }

    #[test]
    fn a_gso_batch_past_64_kib_goes_out_as_sends_of_at_most_64_kib() {
        // Ten jumbo-frame datagrams: 7 + 3 per send.
        assert_eq!(
            send(8972, 10),
            vec![(8972 * 7, Some(8972)), (8972 * 3, Some(8972))]
        );
        // Loopback-sized datagrams go one per send.
        assert_eq!(send(65_495, 3), vec![(65_495, None); 3]);
    }

    #[test]
    fn batches_within_64_kib_and_single_datagrams_pass_unchanged() {
        assert_eq!(send(1452, 10), vec![(14_520, Some(1452))]);
        assert_eq!(send(65_495, 1), vec![(65_495, None)]);
    }

    #[test]
    fn receive_slots_hold_one_coalesced_receive_not_64_full_datagrams() {
        let rec: Arc<dyn AsyncUdpSocket> = Arc::new(Recorder::default());
        assert_eq!(
            KernelSizedUdp::wrap(rec.clone(), 65_527).max_receive_segments(),
            2
        );
        assert_eq!(
            KernelSizedUdp::wrap(rec.clone(), 8972).max_receive_segments(),
            8
        );
        assert_eq!(KernelSizedUdp::wrap(rec, 1452).max_receive_segments(), 46);
    }
}
