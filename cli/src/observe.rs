//! What every `kvpipe` command reports besides its own output: the `tracing` subscriber (quiet
//! by default, `RUST_LOG` to change it, on stderr) and the Prometheus endpoint of
//! `kvpipe serve --metrics`.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::EnvFilter;

use super::CliError;

/// The environment variable that turns observing off (`KVPIPE_OBSERVE=off`): no subscriber,
/// no observer records anything. For measuring what observing costs.
pub(crate) const SWITCH: &str = "KVPIPE_OBSERVE";

/// Installs the subscriber: `RUST_LOG` directives (default `error`: the commands name every
/// failed request themselves, so the sessions' warnings would say it twice), request spans
/// reported when they close, on stderr. With `KVPIPE_OBSERVE=off` installs nothing and turns every
/// observer off.
pub(crate) fn init() {
    if std::env::var(SWITCH).is_ok_and(|v| v == "off" || v == "0") {
        kvpipe_observe::set_enabled(false);
        return;
    }
    let filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::ERROR.into())
        .from_env_lossy();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_span_events(FmtSpan::CLOSE)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .try_init();
}

/// Bucket bounds of every `_seconds` histogram: 0.5 ms to 30 s.
const SECONDS_BUCKETS: [f64; 16] = [
    0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
    30.0,
];

/// A running `/metrics` endpoint serving the process's metrics in Prometheus text format.
pub(crate) struct MetricsEndpoint {
    addr: SocketAddr,
    server: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsEndpoint {
    /// Installs the Prometheus recorder as the process's recorder (before any node is made:
    /// observers take their metric handles when they are made) and serves it at
    /// `http://<addr>/metrics` (port 0 picks a free one; see [`addr`](Self::addr)).
    pub(crate) fn start(addr: &str) -> Result<Self, CliError> {
        let handle = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)?
            .install_recorder()?;
        kvpipe_observe::names::describe();
        let server =
            Arc::new(tiny_http::Server::http(addr).map_err(|e| format!("--metrics {addr}: {e}"))?);
        let addr = server
            .server_addr()
            .to_ip()
            .ok_or("the metrics endpoint is not on an IP address")?;
        let serving = server.clone();
        let thread = std::thread::Builder::new()
            .name("kvpipe-metrics".into())
            .spawn(move || answer(&serving, &handle))?;
        Ok(MetricsEndpoint {
            addr,
            server,
            thread: Some(thread),
        })
    }

    /// The address it listens on.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Answers every request until the server is unblocked: `GET /metrics` with the rendered
/// metrics, anything else with 404.
fn answer(server: &tiny_http::Server, handle: &PrometheusHandle) {
    for request in server.incoming_requests() {
        let response = if request.url() == "/metrics" {
            handle.run_upkeep();
            let header = tiny_http::Header::from_bytes(
                &b"Content-Type"[..],
                &b"text/plain; version=0.0.4"[..],
            )
            .expect("a valid header");
            tiny_http::Response::from_string(handle.render()).with_header(header)
        } else {
            tiny_http::Response::from_string("see /metrics\n").with_status_code(404)
        };
        // A scraper that went away: nothing to do.
        let _ = request.respond(response);
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
