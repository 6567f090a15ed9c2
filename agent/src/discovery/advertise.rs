//! The peer addresses a node advertises, and the one a peer dials.
//!
//! A node on a dual-stack network advertises an address of each family
//! (`swarm.advertise`, `--advertise`): announces carry them comma-separated
//! in the one address field the tracker stores and hands out unread
//! (`10.0.0.1:7881,[fd00::1]:7881`), so a tracker needs no change and a
//! node advertising one address announces exactly what it did before. A
//! peer dials the first advertised address its own endpoint can reach: one
//! of its own family, or any from an endpoint bound to `[::]` (dual-stack,
//! as Linux binds it unless `net.ipv6.bindv6only` is set).
//!
//! An entry may be a bare IP address, which takes the peer endpoint's port:
//! a DaemonSet passes Kubernetes' `status.hostIPs` (`10.0.0.1,fd00::1` on a
//! dual-stack node) as it is. An IPv6 address with a port is written in
//! brackets (`[fd00::1]:7881`); unbracketed, `fd00::1:7881` is one address.

use dray_protocol::scheduler::MAX_ADDRESS_BYTES;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

/// One address a node advertises to its peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Advertised {
    Addr(SocketAddr),
    /// Takes the peer endpoint's port.
    Ip(IpAddr),
}

impl Advertised {
    /// The socket address, with `port` for a bare IP address.
    pub fn with_port(self, port: u16) -> SocketAddr {
        match self {
            Advertised::Addr(a) => a,
            Advertised::Ip(ip) => SocketAddr::new(ip, port),
        }
    }
}

impl FromStr for Advertised {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if let Ok(a) = s.parse() {
            return Ok(Advertised::Addr(a));
        }
        s.parse().map(Advertised::Ip).map_err(|_| {
            format!(
                "{s:?} is not an address and port such as 10.0.0.1:7881 or [fd00::1]:7881, nor an IP address (which takes the peer endpoint's port)"
            )
        })
    }
}

impl std::fmt::Display for Advertised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Advertised::Addr(a) => a.fmt(f),
            Advertised::Ip(ip) => ip.fmt(f),
        }
    }
}

/// Parses one address or several, comma-separated (the `--advertise` flag).
pub fn parse_list(s: &str) -> Result<Vec<Advertised>, String> {
    s.split(',')
        .filter(|a| !a.trim().is_empty())
        .map(str::parse)
        .collect()
}

/// Serde for `swarm.advertise`: one address (`"10.0.0.1:7881"`, or several
/// comma-separated) or a list of them.
pub mod serde_list {
    use super::*;

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Written {
        One(String),
        Many(Vec<String>),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Advertised>, D::Error> {
        let written = Written::deserialize(d)
            .map_err(|_| serde::de::Error::custom("expected an address, or a list of addresses"))?;
        let text = match written {
            Written::One(s) => s,
            Written::Many(v) => v.join(","),
        };
        parse_list(&text).map_err(serde::de::Error::custom)
    }

    pub fn serialize<S: Serializer>(v: &[Advertised], s: S) -> Result<S::Ok, S::Error> {
        v.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .serialize(s)
    }
}

/// What an announce carries for a node whose endpoint is bound to
/// `endpoint`: the advertised addresses, comma-separated, or the
/// endpoint's own address when none is configured.
pub fn announced(advertise: &[Advertised], endpoint: SocketAddr) -> String {
    if advertise.is_empty() {
        return endpoint.to_string();
    }
    advertise
        .iter()
        .map(|a| a.with_port(endpoint.port()).to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Refuses advertised addresses whose announce field (see [`announced`])
/// would be longer than the tracker takes: every announce would be refused.
pub fn check(advertise: &[Advertised], endpoint: SocketAddr) -> crate::Result<()> {
    let field = announced(advertise, endpoint);
    if field.len() > MAX_ADDRESS_BYTES {
        return Err(crate::Error::Config(format!(
            "swarm.advertise: {} addresses take {} bytes in an announce, more than the {MAX_ADDRESS_BYTES} a tracker takes",
            advertise.len(),
            field.len()
        )));
    }
    Ok(())
}

/// The first of a peer's announced addresses that an endpoint bound to
/// `local` can reach, if any.
pub fn reachable(announced: &str, local: SocketAddr) -> Option<SocketAddr> {
    let dual_stack = matches!(local.ip(), IpAddr::V6(ip) if ip.is_unspecified());
    announced
        .split(',')
        .filter_map(|a| a.trim().parse::<SocketAddr>().ok())
        .find(|a| dual_stack || a.is_ipv4() == local.is_ipv4())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_list_takes_addresses_and_bare_ips_and_names_a_bad_entry() {
        let v = parse_list("10.0.0.1, fd00::1,[fd00::2]:9000").unwrap();
        assert_eq!(
            v,
            vec![
                Advertised::Ip("10.0.0.1".parse().unwrap()),
                Advertised::Ip("fd00::1".parse().unwrap()),
                Advertised::Addr(addr("[fd00::2]:9000")),
            ]
        );
        assert_eq!(
            announced(&v, addr("[::]:7881")),
            "10.0.0.1:7881,[fd00::1]:7881,[fd00::2]:9000"
        );
        let e = parse_list("10.0.0.1:7881,node-a").unwrap_err();
        assert!(e.starts_with("\"node-a\" is not an address"), "{e}");
    }

    #[test]
    fn the_setting_takes_one_address_or_a_list_and_names_a_bad_one() {
        use crate::pull::swarm::SwarmConfig;
        use dray_protocol::settings::from_toml;
        let one: SwarmConfig = from_toml("advertise = \"10.0.0.1:7881\"").unwrap();
        assert_eq!(one.advertise, vec![Advertised::Addr(addr("10.0.0.1:7881"))]);
        let two: SwarmConfig = from_toml("advertise = [\"10.0.0.1\", \"[fd00::1]:7881\"]").unwrap();
        assert_eq!(two.advertise.len(), 2);
        let e = from_toml::<SwarmConfig>("advertise = [\"10.0.0.1\", \"node-a:7881\"]")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("key `advertise`: \"node-a:7881\" is not an address"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn more_addresses_than_an_announce_carries_are_refused_at_start() {
        let ca = crate::identity::ClusterCa::generate().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let many: Vec<String> = (1..=12)
            .map(|i| format!("[fd00:1234:5678::{i}:1:2:3]:7881"))
            .collect();
        let cfg = crate::config::AgentConfig {
            state_dir: dir.path().to_path_buf(),
            peer_listen: addr("127.0.0.1:0"),
            swarm: crate::pull::swarm::SwarmConfig {
                advertise: parse_list(&many.join(",")).unwrap(),
                ..Default::default()
            },
            ..Default::default()
        };
        let e = crate::Agent::open(&cfg, ca.issue("a").unwrap(), Default::default())
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.contains("swarm.advertise: 12 addresses take") && e.contains("more than the 256"),
            "{e}"
        );
        // Two of each family fit.
        assert!(
            check(
                &parse_list("10.0.0.1,10.0.0.2,fd00::1,fd00::2").unwrap(),
                addr("[::]:7881")
            )
            .is_ok()
        );
    }

    #[test]
    fn with_nothing_configured_the_endpoint_address_is_announced() {
        assert_eq!(announced(&[], addr("10.0.0.1:7881")), "10.0.0.1:7881");
        assert_eq!(announced(&[], addr("[fd00::1]:7881")), "[fd00::1]:7881");
    }

    #[test]
    fn a_peer_dials_an_address_its_endpoint_can_reach() {
        let both = "10.0.0.1:7881,[fd00::1]:7881";
        let v6_first = "[fd00::1]:7881,10.0.0.1:7881";
        // An IPv4 endpoint: the IPv4 address, wherever it is listed.
        assert_eq!(
            reachable(v6_first, addr("0.0.0.0:7881")),
            Some(addr("10.0.0.1:7881"))
        );
        // An IPv6 endpoint bound to an address: IPv6 only.
        assert_eq!(
            reachable(both, addr("[fd00::2]:7881")),
            Some(addr("[fd00::1]:7881"))
        );
        assert_eq!(reachable("10.0.0.1:7881", addr("[::1]:7881")), None);
        // A dual-stack endpoint: the first listed.
        assert_eq!(
            reachable(v6_first, addr("[::]:7881")),
            Some(addr("[fd00::1]:7881"))
        );
        assert_eq!(
            reachable(both, addr("[::]:7881")),
            Some(addr("10.0.0.1:7881"))
        );
        // Garbage from the tracker is skipped, not dialled.
        assert_eq!(
            reachable("node-a,10.0.0.1:7881", addr("0.0.0.0:0")),
            Some(addr("10.0.0.1:7881"))
        );
        assert_eq!(reachable("", addr("0.0.0.0:0")), None);
    }
}
