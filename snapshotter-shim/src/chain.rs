//! OCI chain IDs: what a committed layer snapshot is named by, so what a
//! remote commit must check before it writes one. `ChainID(L0) = DiffID(L0)`;
//! `ChainID(Ln) = sha256(ChainID(Ln-1) + " " + DiffID(Ln))`, both as
//! `sha256:<hex>` strings (the image spec's `config.md`).

use dray_protocol::BlobDigest;

/// The chain ID of a layer of diffID `diff_id` on the chain `parent` (none
/// for an image's first layer).
pub fn chain_id(parent: Option<&BlobDigest>, diff_id: &BlobDigest) -> BlobDigest {
    match parent {
        None => *diff_id,
        Some(p) => BlobDigest::of(format!("{p} {diff_id}").as_bytes()),
    }
}

/// The chain ID a parent snapshot stands for, from its name: `""` is no
/// parent; a layer the shim committed is named by its chain ID, one that
/// containerd applied and committed by `<namespace>/<id>/<chain ID>`.
pub fn parent_chain_id(parent: &str) -> Result<Option<BlobDigest>, String> {
    if parent.is_empty() {
        return Ok(None);
    }
    let last = parent.rsplit('/').next().unwrap_or(parent);
    last.parse().map(Some).map_err(|_| {
        format!(
            "parent snapshot {parent:?} is not named by a chain ID, so the chain ID of a layer on it cannot be checked"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(c: char) -> BlobDigest {
        format!("sha256:{}", c.to_string().repeat(64))
            .parse()
            .unwrap()
    }

    #[test]
    fn chain_ids_follow_the_image_spec() {
        assert_eq!(chain_id(None, &d('a')), d('a'));
        // sha256("sha256:aaa… sha256:bbb…"), then on with "sha256:ccc…".
        let ab = chain_id(Some(&d('a')), &d('b'));
        assert_eq!(
            ab.to_string(),
            "sha256:ccd722928bd92476ba1745586fed6e45a102504185ad88cd89e01ff116fd146c"
        );
        assert_eq!(
            chain_id(Some(&ab), &d('c')).to_string(),
            "sha256:c1377126441fb2f5ec2c21ae2a60255331d639e830f0ee1b40a36e52d4c40588"
        );
    }

    #[test]
    fn a_parents_chain_id_is_the_last_part_of_its_name() {
        assert_eq!(parent_chain_id("").unwrap(), None);
        let a = d('a').to_string();
        assert_eq!(parent_chain_id(&a).unwrap(), Some(d('a')));
        assert_eq!(
            parent_chain_id(&format!("k8s.io/12/{a}")).unwrap(),
            Some(d('a'))
        );
        let e = parent_chain_id("base").unwrap_err();
        assert_eq!(
            e,
            "parent snapshot \"base\" is not named by a chain ID, so the chain ID of a layer on it cannot be checked"
        );
    }
}
