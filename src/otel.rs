//! OpenTelemetry export (docs/contract.md, section 2d; docs/otel.md): where spans go, and the
//! assembled spans ([`crate::spans`]) as OTLP spans, sent with the OpenTelemetry crates' own
//! exporter. `bus::otel` runs the export over the projection stream.

use crate::config::OtelSettings;
use crate::spans::{Attr, Span};
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks};
use std::time::{Duration, UNIX_EPOCH};

/// Where and how spans are exported, resolved from the settings and the standard variables.
#[derive(Debug, Clone, PartialEq)]
pub struct Export {
    /// The traces endpoint: `None` lets the exporter read `OTEL_EXPORTER_OTLP_*ENDPOINT` itself
    /// (they are set; the exporter applies the specification's rules to them).
    pub endpoint: Option<String>,
    pub protocol: Protocol,
    pub service_name: String,
    pub timeout: Duration,
    pub max_open: usize,
}

/// The export to run, or `None` when no endpoint is configured anywhere. `env` looks up a
/// variable (`std::env::var` in production). Variables win over the file, as `COLLAB_*`
/// variables do.
pub fn resolve(
    settings: &OtelSettings,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<Export>, String> {
    let set = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    // The variable the exporter reads (the traces one first), checked as the file's is; its
    // value is not repeated in the error, as an endpoint may carry credentials.
    let env_endpoint = [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .into_iter()
    .find_map(|name| set(name).map(|v| (name, v)));
    if let Some((name, value)) = &env_endpoint {
        if !is_http_url(value) {
            return Err(format!(
                "{name} is not an http:// or https:// URL (e.g. http://collector:4318)"
            ));
        }
    }
    let from_env = env_endpoint.is_some();
    let file_endpoint = settings.endpoint.trim();
    if !from_env && file_endpoint.is_empty() {
        return Ok(None);
    }
    let protocol_name = set("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| set("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|| settings.protocol.clone());
    let protocol = match protocol_name.trim() {
        "http/protobuf" => Protocol::HttpBinary,
        "http/json" => Protocol::HttpJson,
        "grpc" => Protocol::Grpc,
        other => {
            return Err(format!(
                "OTLP protocol {other:?} is not one of http/protobuf, http/json, grpc \
                 (OTEL_EXPORTER_OTLP_PROTOCOL or otel.protocol)"
            ))
        }
    };
    let endpoint = (!from_env).then(|| {
        let base = file_endpoint.trim_end_matches('/');
        match protocol {
            Protocol::Grpc => base.to_string(),
            _ => format!("{base}/v1/traces"),
        }
    });
    if let Some(e) = &endpoint {
        if !is_http_url(e) {
            return Err(format!(
                "otel.endpoint {file_endpoint:?} is not an http:// or https:// URL"
            ));
        }
    }
    Ok(Some(Export {
        endpoint,
        protocol,
        service_name: set("OTEL_SERVICE_NAME").unwrap_or_else(|| settings.service_name.clone()),
        timeout: settings.timeout,
        max_open: settings.max_open,
    }))
}

fn is_http_url(endpoint: &str) -> bool {
    let e = endpoint.trim();
    e.starts_with("http://") || e.starts_with("https://")
}

/// The OTLP exporter for `export`, with the service's resource set.
pub fn exporter(export: &Export) -> Result<opentelemetry_otlp::SpanExporter, String> {
    let built = match export.protocol {
        Protocol::Grpc => {
            let b = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_timeout(export.timeout);
            match &export.endpoint {
                Some(e) => b.with_endpoint(e.clone()).build(),
                None => b.build(),
            }
        }
        protocol => {
            let b = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(protocol)
                .with_timeout(export.timeout);
            match &export.endpoint {
                Some(e) => b.with_endpoint(e.clone()).build(),
                None => b.build(),
            }
        }
    };
    let mut exporter = built.map_err(|e| format!("the OTLP exporter: {e}"))?;
    // The resource reads OTEL_RESOURCE_ATTRIBUTES as every SDK does; the service name is ours.
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(export.service_name.clone())
        .build();
    exporter.set_resource(&resource);
    Ok(exporter)
}

/// An assembled span as the SDK's span data.
pub fn span_data(span: Span) -> SpanData {
    let scope = InstrumentationScope::builder("collab-projector")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let time = |ms: i64| UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    let status = match &span.error {
        Some(reason) => Status::error(reason.clone()),
        None => Status::Unset,
    };
    let mut attributes: Vec<KeyValue> = span
        .attributes
        .into_iter()
        .map(|(k, v)| match v {
            Attr::Str(s) => KeyValue::new(k, s),
            Attr::Int(i) => KeyValue::new(k, i),
            Attr::F64(f) => KeyValue::new(k, f),
        })
        .collect();
    if let Some(reason) = span.error {
        attributes.push(KeyValue::new("error.type", reason));
    }
    SpanData {
        span_context: SpanContext::new(
            TraceId::from_bytes(span.trace_id),
            SpanId::from_bytes(span.span_id),
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        ),
        parent_span_id: span
            .parent_span_id
            .map_or(SpanId::INVALID, SpanId::from_bytes),
        parent_span_is_remote: false,
        span_kind: SpanKind::Internal,
        name: span.name.into(),
        start_time: time(span.start_ms),
        end_time: time(span.end_ms),
        attributes,
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status,
        instrumentation_scope: scope,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn no_endpoint_anywhere_means_no_export() {
        let s = OtelSettings::default();
        assert_eq!(resolve(&s, vars(&[])), Ok(None));
        assert_eq!(
            resolve(&s, vars(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")])),
            Ok(None)
        );
    }

    #[test]
    fn the_file_endpoint_gets_the_traces_path_and_variables_win() {
        let s = OtelSettings {
            endpoint: "http://collector:4318/".into(),
            ..OtelSettings::default()
        };
        let e = resolve(&s, vars(&[("OTEL_SERVICE_NAME", "agents-prod")]))
            .ok()
            .flatten();
        assert_eq!(
            e.as_ref().and_then(|e| e.endpoint.as_deref()),
            Some("http://collector:4318/v1/traces")
        );
        assert_eq!(e.map(|e| e.service_name), Some("agents-prod".into()));
        // A variable's endpoint is left to the exporter, which applies the specification.
        let e = resolve(
            &s,
            vars(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://other:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ]),
        )
        .ok()
        .flatten();
        assert_eq!(
            e.map(|e| (e.endpoint, e.protocol)),
            Some((None, Protocol::Grpc))
        );
    }

    #[test]
    fn a_bad_protocol_or_endpoint_is_refused_saying_what_to_use() {
        let s = OtelSettings {
            endpoint: "collector:4318".into(),
            ..OtelSettings::default()
        };
        assert!(resolve(&s, vars(&[])).is_err_and(|e| e.contains("http://")));
        let bad = resolve(
            &s,
            vars(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift"),
            ]),
        );
        assert!(bad.is_err_and(|e| e.contains("http/protobuf")));
        // A variable's endpoint is checked too, named without its value.
        for name in [
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ] {
            let bad = resolve(
                &OtelSettings::default(),
                vars(&[(name, "user:secret@collector:4318")]),
            );
            assert!(
                bad.as_ref()
                    .is_err_and(|e| e.starts_with(name) && !e.contains("secret")),
                "{bad:?}"
            );
        }
        // The traces variable is the one the exporter uses when both are set.
        let both = resolve(
            &OtelSettings::default(),
            vars(&[
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "https://traces:4318"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318"),
            ]),
        );
        assert!(both.is_ok_and(|e| e.is_some()));
    }

    #[test]
    fn a_span_keeps_its_ids_times_and_error_reason() {
        let span = Span {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent_span_id: Some([3; 8]),
            name: "invoke_agent ruda".into(),
            start_ms: 1_000,
            end_ms: 2_500,
            attributes: vec![("gen_ai.usage.input_tokens", Attr::Int(7))],
            error: Some("timeout".into()),
        };
        let d = span_data(span);
        assert_eq!(d.span_context.trace_id(), TraceId::from_bytes([1; 16]));
        assert_eq!(d.parent_span_id, SpanId::from_bytes([3; 8]));
        assert_eq!(
            d.end_time.duration_since(d.start_time).ok(),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(d.status, Status::error("timeout"));
        assert!(d
            .attributes
            .contains(&KeyValue::new("error.type", "timeout")));
        assert!(d
            .attributes
            .contains(&KeyValue::new("gen_ai.usage.input_tokens", 7)));
    }
}
