//! One way to serve an agent's pulls to the node: [`Surfaces::serve`] binds
//! the registry mirror on `mirror.listen` and, if asked, the local API on its
//! unix socket, and serves both through one [`Pulls`] until they are drained
//! or dropped. `dray agent`, the benches and the tests all serve them here,
//! so what they answer is what ships; the peer plane's server is the
//! [`crate::peer::PeerNode`]'s, and the admin endpoint is started apart (by
//! `dray agent`, before the store opens, so health checks answer meanwhile).
//!
//! A stop is in two steps: [`Surfaces::drain`] takes no new connection and
//! lets the requests under way run to their end ([`Surfaces::finished`]);
//! [`Surfaces::abort`] (or dropping the `Surfaces`) ends those at once.

use crate::error::{Error, Result};
use crate::pull::Pulls;
use crate::serving::local_api::{self, LocalApi, LocalApiConfig};
use crate::serving::mirror::{Mirror, MirrorConfig};
use crate::unpack::UnpackLimits;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::watch;
use tokio::task::{JoinError, JoinHandle};

/// The mirror and the local API of one agent, being served.
pub struct Surfaces {
    mirror_addr: SocketAddr,
    mirror: Served,
    api: Option<(Arc<LocalApi>, Served)>,
    /// Set by [`Surfaces::drain`]: the servers take no new connection.
    draining: watch::Sender<bool>,
}

impl Surfaces {
    /// Binds the mirror on `mirror.listen` (port 0 picks a free one, read
    /// back with [`Surfaces::mirror_addr`]) and, with `local_api`, the local
    /// API's socket (a stale socket replaced, mode 0660), and serves them
    /// through `pulls`. The local API holds its pulls to `mirror`'s
    /// registries.
    pub async fn serve(
        pulls: &Arc<Pulls>,
        mirror: MirrorConfig,
        local_api: Option<(&LocalApiConfig, UnpackLimits)>,
    ) -> Result<Surfaces> {
        let listener = tokio::net::TcpListener::bind(mirror.listen)
            .await
            .map_err(|e| Error::io(format!("binding the mirror to {}", mirror.listen), e))?;
        let mirror_addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the mirror's address", e))?;
        let api = match local_api {
            Some((config, limits)) => {
                let socket = local_api::bind(&config.socket).map_err(|e| {
                    Error::io(
                        format!("binding the local API to {}", config.socket.display()),
                        e,
                    )
                })?;
                let api = LocalApi::new(pulls.clone(), mirror.clone(), config, limits);
                Some((api, socket, config.socket.display().to_string()))
            }
            None => None,
        };
        let (draining, drained) = watch::channel(false);
        let until_draining = move || {
            let mut drained = drained.clone();
            async move {
                let _ = drained.wait_for(|d| *d).await;
            }
        };
        let router = Mirror::new(pulls.clone(), mirror).router();
        let mirror = Served::new(
            format!("the mirror on {mirror_addr}"),
            tokio::spawn(
                axum::serve(listener, router)
                    .with_graceful_shutdown(until_draining())
                    .into_future(),
            ),
        );
        let api = api.map(|(api, socket, path)| {
            let task = tokio::spawn(
                axum::serve(socket, api.router())
                    .with_graceful_shutdown(until_draining())
                    .into_future(),
            );
            (api, Served::new(format!("the local API on {path}"), task))
        });
        Ok(Surfaces {
            mirror_addr,
            mirror,
            api,
            draining,
        })
    }

    /// The address the mirror listens on.
    pub fn mirror_addr(&self) -> SocketAddr {
        self.mirror_addr
    }

    /// The mirror's base URL, `http://<addr>`.
    pub fn mirror_url(&self) -> String {
        format!("http://{}", self.mirror_addr)
    }

    /// The local API, if served (its preheat runner is started apart).
    pub fn local_api(&self) -> Option<&Arc<LocalApi>> {
        self.api.as_ref().map(|(api, _)| api)
    }

    /// Resolves if the mirror or the local API stops serving before
    /// [`Surfaces::drain`] (an error of its listener, a panic), with which
    /// and why; never while both serve.
    pub async fn failed(&mut self) -> Error {
        let Surfaces { mirror, api, .. } = self;
        let api = async {
            match api {
                Some((_, api)) => api.failed().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            e = mirror.failed() => e,
            e = api => e,
        }
    }

    /// Takes no new connection; the requests under way run to their end.
    pub fn drain(&self) {
        self.draining.send_replace(true);
    }

    /// Resolves once the mirror and the local API have stopped serving
    /// (after [`Surfaces::drain`], when the requests under way are answered).
    pub async fn finished(&mut self) {
        self.mirror.ended().await;
        if let Some((_, api)) = &mut self.api {
            api.ended().await;
        }
    }

    /// How many of the mirror and the local API are still serving.
    pub fn serving(&self) -> usize {
        std::iter::once(&self.mirror)
            .chain(self.api.as_ref().map(|(_, api)| api))
            .filter(|s| s.serving())
            .count()
    }

    /// Stops serving at once, cutting off the requests under way.
    pub fn abort(&self) {
        self.mirror.abort();
        if let Some((_, api)) = &self.api {
            api.abort();
        }
    }
}

impl Drop for Surfaces {
    fn drop(&mut self) {
        self.abort();
    }
}

/// One server's task, and what it serves (for its errors).
struct Served {
    what: String,
    /// `None` once the task's end has been seen.
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl Served {
    fn new(what: String, task: JoinHandle<std::io::Result<()>>) -> Self {
        Self {
            what,
            task: Some(task),
        }
    }

    /// Resolves when the task ends, with how; `None` at once if its end was
    /// already seen.
    async fn ended(&mut self) -> Option<Result<std::io::Result<()>, JoinError>> {
        let ended = self.task.as_mut()?.await;
        self.task = None;
        Some(ended)
    }

    /// Resolves when the task ends, with why as an error.
    async fn failed(&mut self) -> Error {
        let what = self.what.clone();
        match self.ended().await {
            None => std::future::pending().await,
            Some(Ok(Ok(()))) => Error::Stopped {
                what,
                detail: "its server returned before the stop".into(),
            },
            Some(Ok(Err(e))) => Error::io(format!("serving {what}"), e),
            Some(Err(e)) => Error::Stopped {
                what,
                detail: e.to_string(),
            },
        }
    }

    fn serving(&self) -> bool {
        self.task.as_ref().is_some_and(|t| !t.is_finished())
    }

    fn abort(&self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}
