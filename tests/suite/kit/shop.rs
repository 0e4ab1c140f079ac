//! The demo shop in-process, for the tests and the benchmarks: its base URL, its control
//! endpoints (mutations, faults, request counts, the truth).

use std::collections::{BTreeMap, HashMap};

use seedlock::demo_site::{serve, SiteOptions};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

/// The demo shop in this process, stopped when dropped.
pub struct Shop {
    pub base: String,
    stop: CancellationToken,
}

impl Shop {
    pub async fn start(lists: u32, per_list: u32) -> Shop {
        Self::start_with(lists, per_list, "SKU", 5).await
    }

    /// A shop whose SKUs start with `prefix` (shops on several ports sell different products).
    pub async fn start_named(lists: u32, per_list: u32, prefix: &str) -> Shop {
        Self::start_with(lists, per_list, prefix, 5).await
    }

    /// A shop of `lists × per_list` products, SKUs `prefix-…`, catalogue and mutations from
    /// `seed`.
    pub async fn start_with(lists: u32, per_list: u32, prefix: &str, seed: u64) -> Shop {
        Self::start_options(SiteOptions {
            lists,
            per_list,
            seed,
            sku_prefix: prefix.to_owned(),
            ..SiteOptions::default()
        })
        .await
    }

    /// A shop made as `options` say.
    pub async fn start_options(options: SiteOptions) -> Shop {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let stop = CancellationToken::new();
        tokio::spawn(serve(listener, options, stop.clone()));
        Shop { base, stop }
    }

    pub async fn post(&self, path: &str, body: Value) -> Value {
        super::crawl::post(&format!("{}{path}", self.base), body).await
    }

    /// Requests per path since the last call.
    pub async fn stats(&self) -> BTreeMap<String, u64> {
        let v: Value = reqwest::get(format!("{}/__stats?reset=true", self.base))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["paths"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
            .collect()
    }

    /// Request arrival times (Unix ms) of the crawled pages (listing and product pages).
    pub async fn page_times(&self) -> Vec<i64> {
        let v: Value = reqwest::get(format!("{}/__stats?log=true", self.base))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["log"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| {
                let p = e[0].as_str().unwrap_or_default();
                p.starts_with("/list/") || p.starts_with("/product/")
            })
            .map(|e| e[1].as_i64().unwrap())
            .collect()
    }

    pub async fn truth(&self) -> HashMap<String, (String, String, String)> {
        super::crawl::truth(&self.base).await
    }
}

impl Shop {
    /// Keeps the shop running after this handle is gone (a test's shop lives as long as the
    /// test); returns its base URL.
    pub fn leak(self) -> String {
        let base = self.base.clone();
        std::mem::forget(self);
        base
    }
}

impl Drop for Shop {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
