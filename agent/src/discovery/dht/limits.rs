//! A cap on the DHT connections one address has in their TLS handshake at
//! once. libp2p's connection limits cap the handshakes of all addresses
//! together; without this, one host that opens connections and never
//! completes them holds that whole room, and no new member can join while
//! it does. With it, a host fills only its own [`MAX_PENDING_PER_ADDRESS`].
//!
//! An address is the remote IP: a flood from many addresses meets the
//! global cap (see the module above), which still bounds what it costs.

use libp2p::PeerId;
use libp2p::core::transport::PortUse;
use libp2p::core::{Endpoint, Multiaddr};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::{
    ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler, THandlerInEvent,
    THandlerOutEvent, ToSwarm, dummy,
};
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::task::{Context, Poll};

/// Connections one remote address may have in their handshake at once: a
/// node dials another once or twice (each side may dial), a host of several
/// nodes (a test, a VM) a few more.
pub const MAX_PENDING_PER_ADDRESS: usize = 16;

/// Why a connection was closed before its handshake.
#[derive(Debug, thiserror::Error)]
#[error("{ip} already has {max} DHT connections in their handshake")]
pub struct TooManyPending {
    ip: IpAddr,
    max: usize,
}

/// The behaviour that counts handshakes per remote address.
#[derive(Debug)]
pub struct PendingPerAddress {
    max: usize,
    pending: HashMap<ConnectionId, IpAddr>,
    by_address: HashMap<IpAddr, usize>,
}

impl PendingPerAddress {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            pending: HashMap::new(),
            by_address: HashMap::new(),
        }
    }

    /// Admits one more handshake from `remote`, or refuses it.
    fn admit(&mut self, id: ConnectionId, remote: &Multiaddr) -> Result<(), TooManyPending> {
        let Some(ip) = ip_of(remote) else {
            return Ok(());
        };
        let n = self.by_address.entry(ip).or_default();
        if *n >= self.max {
            return Err(TooManyPending { ip, max: self.max });
        }
        *n += 1;
        self.pending.insert(id, ip);
        Ok(())
    }

    /// The handshake of `id` ended, whichever way.
    fn release(&mut self, id: ConnectionId) {
        let Some(ip) = self.pending.remove(&id) else {
            return;
        };
        if let Some(n) = self.by_address.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.by_address.remove(&ip);
            }
        }
    }
}

fn ip_of(addr: &Multiaddr) -> Option<IpAddr> {
    addr.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
        Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
        _ => None,
    })
}

impl NetworkBehaviour for PendingPerAddress {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_pending_inbound_connection(
        &mut self,
        id: ConnectionId,
        _local: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<(), ConnectionDenied> {
        self.admit(id, remote).map_err(ConnectionDenied::new)
    }

    fn handle_established_inbound_connection(
        &mut self,
        id: ConnectionId,
        _peer: PeerId,
        _local: &Multiaddr,
        _remote: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.release(id);
        Ok(dummy::ConnectionHandler)
    }

    fn handle_established_outbound_connection(
        &mut self,
        _id: ConnectionId,
        _peer: PeerId,
        _addr: &Multiaddr,
        _role: Endpoint,
        _port_use: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        // A handshake that failed, timed out, or was refused by another cap.
        if let FromSwarm::ListenFailure(failure) = event {
            self.release(failure.connection_id);
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _peer: PeerId,
        _id: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(&mut self, _: &mut Context<'_>) -> Poll<ToSwarm<Infallible, THandlerInEvent<Self>>> {
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(ip: &str) -> Multiaddr {
        format!("/ip4/{ip}/tcp/40000").parse().unwrap()
    }

    #[test]
    fn one_address_fills_only_its_own_room_and_gets_it_back_as_handshakes_end() {
        let mut caps = PendingPerAddress::new(2);
        let ids: Vec<ConnectionId> = (1..=4).map(ConnectionId::new_unchecked).collect();
        assert!(caps.admit(ids[0], &from("10.0.0.1")).is_ok());
        assert!(caps.admit(ids[1], &from("10.0.0.1")).is_ok());
        let refused = caps.admit(ids[2], &from("10.0.0.1")).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "10.0.0.1 already has 2 DHT connections in their handshake"
        );
        assert!(
            caps.admit(ids[3], &from("10.0.0.2")).is_ok(),
            "another address"
        );
        caps.release(ids[0]);
        caps.release(ids[2]); // never admitted: nothing to give back
        assert!(caps.admit(ids[2], &from("10.0.0.1")).is_ok());
        for id in &ids {
            caps.release(*id);
        }
        assert!(caps.by_address.is_empty() && caps.pending.is_empty());
    }
}
