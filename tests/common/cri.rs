//! A CRI image-service client on containerd's socket, as the kubelet has
//! (the `runtime.v1` protos compiled by build.rs). Included with `#[path]` by
//! the tests that pull through CRI, so the others do not compile it.

pub mod pb {
    tonic::include_proto!("runtime.v1");
}

use pb::image_service_client::ImageServiceClient;
use std::path::Path;

pub type Client = ImageServiceClient<tonic::transport::Channel>;

/// Connects to containerd's gRPC socket.
pub async fn client(socket: &Path) -> Client {
    let path = socket.to_path_buf();
    let channel = tonic::transport::Endpoint::try_from("http://containerd")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .unwrap();
    ImageServiceClient::new(channel)
}

/// `PullImage`, as the kubelet sends it: the image's id on success.
pub async fn pull_image(client: &mut Client, image: &str) -> Result<String, tonic::Status> {
    client
        .pull_image(pb::PullImageRequest {
            image: Some(pb::ImageSpec {
                image: image.to_string(),
                ..Default::default()
            }),
            auth: None,
        })
        .await
        .map(|r| r.into_inner().image_ref)
}
