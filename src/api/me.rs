//! `GET /api/me`: who the caller is to the API and which roles it may read, so a UI shows only
//! what the token allows.

use super::auth::Caller;
use super::query::NoQuery;
use super::state::ApiState;
use crate::model::Role;
use axum::extract::State;
use axum::{Extension, Json};
use schemars::JsonSchema;
use serde::Serialize;

/// The caller as the API sees it.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct Me {
    /// Whether access control is on (bearer tokens are configured).
    pub access_control: bool,
    /// The name of the token's grant; `null` with access control off.
    pub grant: Option<String>,
    /// The roles the caller may read, in the order of the role list.
    pub roles: Vec<Role>,
}

pub async fn me(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    _: NoQuery,
) -> Json<Me> {
    Json(Me {
        access_control: state.grants().enabled(),
        grant: caller.name,
        roles: caller.allowed,
    })
}
