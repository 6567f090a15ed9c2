//! The gRPC face: `containerd.services.snapshots.v1.Snapshots` on a unix
//! socket, translating requests to [`Snapshotter`] calls and errors to the
//! codes containerd's proxy client understands.

use crate::agent::LayerSource;
use crate::config::SnapshotterConfig;
use crate::error::SnapshotError;
use crate::meta::Kind;
use crate::pb::snapshots as pb;
use crate::pb::snapshots::snapshots_server::{Snapshots, SnapshotsServer};
use crate::snapshotter::{Info, Labels, Snapshotter, blocking};
use std::collections::HashMap;
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status};

/// Infos per `List` message: containerd reads the stream to its end, and
/// one message per snapshot costs a frame each.
const LIST_BATCH: usize = 100;

/// The service over one snapshotter.
pub struct SnapshotService<A> {
    snapshotter: Arc<Snapshotter<A>>,
}

impl<A: LayerSource> SnapshotService<A> {
    pub fn new(snapshotter: Arc<Snapshotter<A>>) -> Self {
        SnapshotService { snapshotter }
    }

    async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Snapshotter<A>) -> Result<T, SnapshotError> + Send + 'static,
    ) -> Result<T, Status> {
        let this = self.snapshotter.clone();
        Ok(blocking(move || f(&this)).await?)
    }
}

fn labels(map: HashMap<String, String>) -> Labels {
    map.into_iter().collect()
}

fn to_pb(info: Info) -> pb::Info {
    let kind = match info.record.kind {
        Kind::View => pb::Kind::View,
        Kind::Active => pb::Kind::Active,
        Kind::Committed => pb::Kind::Committed,
    };
    pb::Info {
        name: info.name,
        parent: info.record.parent,
        kind: kind as i32,
        created_at: Some(info.record.created.into()),
        updated_at: Some(info.record.updated.into()),
        labels: info.record.labels.into_iter().collect(),
    }
}

#[tonic::async_trait]
impl<A: LayerSource> Snapshots for SnapshotService<A> {
    async fn prepare(
        &self,
        request: Request<pb::PrepareSnapshotRequest>,
    ) -> Result<Response<pb::PrepareSnapshotResponse>, Status> {
        let r = request.into_inner();
        let mounts = self
            .snapshotter
            .prepare(&r.key, &r.parent, labels(r.labels))
            .await?;
        Ok(Response::new(pb::PrepareSnapshotResponse { mounts }))
    }

    async fn view(
        &self,
        request: Request<pb::ViewSnapshotRequest>,
    ) -> Result<Response<pb::ViewSnapshotResponse>, Status> {
        let r = request.into_inner();
        let mounts = self
            .call(move |s| s.view(&r.key, &r.parent, labels(r.labels)))
            .await?;
        Ok(Response::new(pb::ViewSnapshotResponse { mounts }))
    }

    async fn mounts(
        &self,
        request: Request<pb::MountsRequest>,
    ) -> Result<Response<pb::MountsResponse>, Status> {
        let r = request.into_inner();
        let mounts = self.call(move |s| s.mounts(&r.key)).await?;
        Ok(Response::new(pb::MountsResponse { mounts }))
    }

    async fn commit(
        &self,
        request: Request<pb::CommitSnapshotRequest>,
    ) -> Result<Response<()>, Status> {
        let r = request.into_inner();
        self.call(move |s| s.commit(&r.name, &r.key, labels(r.labels)))
            .await?;
        Ok(Response::new(()))
    }

    async fn remove(
        &self,
        request: Request<pb::RemoveSnapshotRequest>,
    ) -> Result<Response<()>, Status> {
        let r = request.into_inner();
        self.call(move |s| s.remove(&r.key)).await?;
        Ok(Response::new(()))
    }

    async fn stat(
        &self,
        request: Request<pb::StatSnapshotRequest>,
    ) -> Result<Response<pb::StatSnapshotResponse>, Status> {
        let r = request.into_inner();
        let info = self.call(move |s| s.stat(&r.key)).await?;
        Ok(Response::new(pb::StatSnapshotResponse {
            info: Some(to_pb(info)),
        }))
    }

    async fn update(
        &self,
        request: Request<pb::UpdateSnapshotRequest>,
    ) -> Result<Response<pb::UpdateSnapshotResponse>, Status> {
        let r = request.into_inner();
        let info = r.info.ok_or_else(|| {
            Status::invalid_argument("Update needs an info with the snapshot's name")
        })?;
        let paths = r.update_mask.map(|m| m.paths).unwrap_or_default();
        let info = self
            .call(move |s| s.update(&info.name, &labels(info.labels), &paths))
            .await?;
        Ok(Response::new(pb::UpdateSnapshotResponse {
            info: Some(to_pb(info)),
        }))
    }

    type ListStream =
        tokio_stream::Iter<std::vec::IntoIter<Result<pb::ListSnapshotsResponse, Status>>>;

    async fn list(
        &self,
        request: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<Self::ListStream>, Status> {
        let r = request.into_inner();
        let infos = self.call(move |s| s.list(&r.filters)).await?;
        let mut messages = Vec::new();
        let mut infos = infos.into_iter().map(to_pb).peekable();
        while infos.peek().is_some() {
            let info = infos.by_ref().take(LIST_BATCH).collect();
            messages.push(Ok(pb::ListSnapshotsResponse { info }));
        }
        Ok(Response::new(tokio_stream::iter(messages)))
    }

    async fn usage(
        &self,
        request: Request<pb::UsageRequest>,
    ) -> Result<Response<pb::UsageResponse>, Status> {
        let r = request.into_inner();
        let usage = self.call(move |s| s.usage(&r.key)).await?;
        Ok(Response::new(pb::UsageResponse {
            size: usage.size,
            inodes: usage.inodes,
        }))
    }

    async fn cleanup(&self, _request: Request<pb::CleanupRequest>) -> Result<Response<()>, Status> {
        self.call(|s| s.cleanup()).await?;
        Ok(Response::new(()))
    }
}

/// Why the snapshotter could not serve.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("opening the snapshotter: {0}")]
    Open(#[from] SnapshotError),
    #[error("socket {}: {source}", path.display())]
    Socket {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves `config.socket` (mode 0660, a stale socket file replaced) until
/// `shutdown` completes, then finishes the calls in flight.
pub async fn serve<A: LayerSource>(
    config: &SnapshotterConfig,
    agent: A,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let snapshotter = Snapshotter::open(
        &config.root,
        agent,
        config.prefetch_limit,
        config.staged_ttl,
    )?;
    let socket_error = |source| ServeError::Socket {
        path: config.socket.clone(),
        source,
    };
    if let Some(dir) = config.socket.parent() {
        std::fs::create_dir_all(dir).map_err(socket_error)?;
    }
    match std::fs::remove_file(&config.socket) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(socket_error(e)),
        _ => {}
    }
    let listener = tokio::net::UnixListener::bind(&config.socket).map_err(socket_error)?;
    std::fs::set_permissions(&config.socket, std::fs::Permissions::from_mode(0o660))
        .map_err(socket_error)?;
    let sweeper = snapshotter.spawn_sweeper(
        config
            .staged_ttl
            .clamp(Duration::from_secs(1), Duration::from_secs(60)),
    );
    let served = tonic::transport::Server::builder()
        .add_service(SnapshotsServer::new(SnapshotService::new(snapshotter)))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            shutdown,
        )
        .await;
    sweeper.abort();
    let _ = std::fs::remove_file(&config.socket);
    Ok(served?)
}
