//! The configuration's tests: the documented and shipped files parse, every key is in the
//! README's reference, bad values name their key, secrets are never shown.

use super::*;

const EXAMPLE: &str = r#"
[mongo]
uri = "mongodb://127.0.0.1:27017"
database = "seedlock"
[instance]
id = ""
[lock]
ttl = "30s"
heartbeat = "10s"
max_refresh = "10m"
poll = "1s"
[[bots]]
id = "shop"
seeds = { url = "http://127.0.0.1:8000/seeds.txt", format = "lines" }
refresh = "daily"
on_refresh_failure = "keep_previous"
[[bots]]
id = "static"
seeds = ["https://example.com/a", "https://EXAMPLE.com/a#frag"]
refresh = "6h"
on_refresh_failure = "wait"
"#;

fn no_env(_: &str) -> Option<String> {
    None
}

#[test]
fn the_documented_example_parses() {
    let s = Settings::from_toml(EXAMPLE, no_env).unwrap();
    assert_eq!(s.mongo.database, "seedlock");
    assert_eq!(s.lock.ttl, Duration::from_secs(30));
    assert_eq!(s.lock.heartbeat, Duration::from_secs(10));
    assert_eq!(s.bots.len(), 2);
    assert_eq!(s.bots[0].refresh, RefreshSchedule::Daily);
    assert_eq!(
        s.bots[1].refresh,
        RefreshSchedule::Every(Duration::from_secs(6 * 3600))
    );
    assert_eq!(s.bots[1].on_refresh_failure, OnRefreshFailure::Wait);
    match &s.bots[1].seeds {
        SeedSource::Static(urls) => assert_eq!(urls.len(), 1, "normalized duplicates collapse"),
        other => panic!("expected a static list, got {other:?}"),
    }
    assert!(
        s.instance_id.as_str().contains(':'),
        "an empty id is generated as host:pid:random"
    );
}

#[test]
fn the_shipped_configs_parse() {
    let compose = Settings::from_toml(include_str!("../../deploy/seedlock.toml"), no_env).unwrap();
    assert!(
        compose.bots_from_database(),
        "the compose instances run the database's bots"
    );
    let bots = specs_from_file(Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/bots.toml"
    )))
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(bots.len(), 3);
    // The README's configuration reference is a complete, valid config (with the variable
    // its secret header names set, as on an instance; nextest runs each test alone).
    std::env::set_var("SHOP_TOKEN", "t");
    std::env::set_var("SHOP_PROXY", "socks5://127.0.0.1:1080");
    std::env::set_var("SHOP_COOKIE", "c");
    std::env::set_var("HOOK_TOKEN", "h");
    let s = Settings::from_toml(readme_reference(), no_env)
        .unwrap_or_else(|e| panic!("README config: {e}"));
    assert_eq!(s.lock.heartbeat, Duration::from_secs(10));
    assert_eq!(
        s.refresh.user_agent,
        concat!("seedlock/", env!("CARGO_PKG_VERSION"))
    );
}

/// The README's configuration reference, as text.
fn readme_reference() -> &'static str {
    let readme = include_str!("../../README.md");
    let start = readme
        .find("## Configuration reference")
        .expect("README has the reference");
    let block = &readme[start..];
    let body = &block[block.find("```toml").unwrap() + 7..];
    &body[..body.find("```").unwrap()]
}

/// Every key path of a TOML value: `crawl.workers`, `bots[].crawl.list.item`; the keys of the
/// free-form maps (`crawl.hosts`, `bots[].crawl.record.fields`) become `*`.
fn key_paths(value: &toml::Value, prefix: &str, out: &mut std::collections::BTreeSet<String>) {
    match value {
        toml::Value::Table(table) => {
            let free_form = prefix.ends_with("crawl.hosts")
                || prefix.ends_with("record.fields")
                || prefix.ends_with("crawl.headers")
                || prefix.ends_with("notify.headers")
                || prefix.ends_with("crawl.cookies");
            for (key, child) in table {
                let key = if free_form { "*" } else { key.as_str() };
                let path = if prefix.is_empty() {
                    key.to_owned()
                } else {
                    format!("{prefix}.{key}")
                };
                out.insert(path.clone());
                key_paths(child, &path, out);
            }
        }
        toml::Value::Array(items) => {
            for item in items.iter().filter(|item| item.is_table()) {
                key_paths(item, &format!("{prefix}[]"), out);
            }
        }
        _ => {}
    }
}

/// Every key the file format has, from a config with every optional part present. A struct
/// literal without `..`: a new field in any `Raw*` struct fails to compile here until it is
/// added, and then the test below fails until the README documents it.
fn every_key() -> std::collections::BTreeSet<String> {
    let full = RawConfig {
        changes: RawChanges { ttl: "7d".into() },
        mongo: RawMongo {
            uri: "mongodb://h".into(),
            database: "d".into(),
            connect_timeout: "1s".into(),
            server_selection_timeout: "1s".into(),
            op_timeout: "1s".into(),
            max_pool_size: 1,
        },
        instance: RawInstance {
            id: "i".into(),
            bots: vec!["shop-*".into()],
        },
        lock: RawLock {
            ttl: "1s".into(),
            heartbeat: Some("1s".into()),
            max_refresh: "1s".into(),
            stuck_grace: Some("1s".into()),
            poll: "1s".into(),
        },
        refresh: RawRefresh {
            timeout: "1s".into(),
            max_bytes: 1,
            max_seeds: 1,
            attempts: 1,
            backoff_base: "1s".into(),
            backoff_max: "1s".into(),
            sitemap_depth: 1,
            user_agent: "u".into(),
            concurrency: 1,
        },
        crawl: RawCrawlLimits {
            workers: 1,
            host_queue: 1,
            writers: 1,
            parsers: 1,
            parse_queue: 1,
            store_queue: 1,
            max_uncommitted: 1,
            max_uncommitted_bytes: 1024,
            store_delay: "0s".into(),
            host_limit: 1,
            host_limit_min: 1,
            host_limit_max: 1,
            politeness: "0s".into(),
            retry_budget: 0.1,
            retry_budget_min: 1,
            retry_window: "1s".into(),
            robots: true,
            robots_ttl: "1s".into(),
            robots_retry: "1s".into(),
            shed_after: "1s".into(),
            max_pass: "1s".into(),
            hosts: [(
                "h:1".to_owned(),
                RawHostOverride {
                    max_limit: Some(1),
                    min_delay: Some("1s".into()),
                },
            )]
            .into(),
            lease: "1s".into(),
            timeout: "1s".into(),
            max_page_bytes: 1,
            attempts: 1,
            backoff_base: "1s".into(),
            backoff_max: "1s".into(),
            transactions: Transactions::Auto,
            min_coverage: 0.5,
            max_error_rate: 0.5,
        },
        http: RawHttp {
            listen: "off".into(),
        },
        log: RawLog {
            format: LogFormat::Text,
            level: "info".into(),
        },
        bots: vec![RawBot {
            id: "b".into(),
            seeds: RawSeeds::Source(RawSeedSource {
                url: "http://h/".into(),
                format: SeedFormat::Lines,
            }),
            refresh: "daily".into(),
            on_refresh_failure: OnRefreshFailure::Wait,
            crawl: Some(RawCrawl {
                scope: vec!["h".into()],
                follow: "a".into(),
                allow: vec!["a".into()],
                deny: vec!["d".into()],
                strip_query: vec!["s".into()],
                max_links: 7,
                list: Some(RawList {
                    item: "i".into(),
                    item_id: "@id".into(),
                    item_link: "a@href".into(),
                    fingerprint: vec!["f".into()],
                    updated_at: Some("@u".into()),
                }),
                record: Some(RawRecord {
                    url_match: "/p/".into(),
                    natural_key: ".k".into(),
                    fields: [("f".to_owned(), "s".into())].into(),
                }),
                incremental: RawIncremental {
                    mode: "full".into(),
                    overlap: "1s".into(),
                },
                priority: vec![RawPriority {
                    url_match: "/".into(),
                    priority: 1,
                }],
                headers: [
                    ("a".to_owned(), RawHeader::Value("v".into())),
                    ("b".to_owned(), RawHeader::Env { env: "E".into() }),
                ]
                .into(),
                user_agent: Some("ua".into()),
                sitemaps: vec!["http://h/s.xml".into()],
                sitemaps_from_robots: true,
                max_depth: 7,
                max_pages: 8,
                max_pages_per_host: 9,
                max_url_length: 100,
                proxy: Some(RawEnv { env: "P".into() }),
                cookies: [("c".to_owned(), RawHeader::Env { env: "C".into() })].into(),
                notify: Some(RawNotify {
                    url: "http://h/hook".into(),
                    headers: [
                        ("a".to_owned(), RawHeader::Value("v".into())),
                        ("b".to_owned(), RawHeader::Env { env: "E".into() }),
                    ]
                    .into(),
                    batch: Some(10),
                    timeout: Some("5s".into()),
                }),
                drift: Some(RawDrift {
                    max_fill_drop: Some(0.3),
                    max_removed: Some(0.5),
                    min_records: Some(10),
                }),
            }),
        }],
    };
    let mut keys = std::collections::BTreeSet::new();
    key_paths(&toml::Value::try_from(&full).unwrap(), "", &mut keys);
    keys
}

#[test]
fn every_config_key_is_documented_in_the_readme() {
    let known = every_key();
    assert!(known.contains("crawl.hosts.*.min_delay"), "{known:?}");
    assert!(known.contains("bots[].crawl.priority[].match"), "{known:?}");
    let mut documented = std::collections::BTreeSet::new();
    key_paths(
        &readme_reference().parse::<toml::Value>().unwrap(),
        "",
        &mut documented,
    );
    let undocumented: Vec<_> = known.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "config keys missing from the README's configuration reference: {undocumented:?}"
    );
    let unknown: Vec<_> = documented.difference(&known).collect();
    assert!(
        unknown.is_empty(),
        "the README documents keys the config does not have: {unknown:?}"
    );
}

#[test]
fn the_crawl_example_parses() {
    let text = r#"
[[bots]]
id = "shop"
seeds = { url = "http://127.0.0.1:8080/seeds.txt" }
[bots.crawl]
scope = ["127.0.0.1:8080"]
follow = "a[href]"
strip_query = ["utm_*", "ref"]
[bots.crawl.list]
item = ".item"
item_id = "@data-id"
item_link = "a@href"
fingerprint = [".price", ".status", ".title"]
[bots.crawl.record]
match = "/product/"
natural_key = ".sku"
fields = { title = "h1", price = ".price", status = ".status" }
[bots.crawl.incremental]
mode = "fingerprint"
overlap = "5m"
"#;
    let s = Settings::from_toml(text, no_env).unwrap();
    let crawl = s.bots[0].crawl.as_ref().expect("a crawl section");
    assert_eq!(crawl.list.as_ref().unwrap().fingerprint.len(), 3);
    assert_eq!(crawl.record.as_ref().unwrap().fields.len(), 3);
    assert_eq!(crawl.incremental.mode, IncrementalMode::Fingerprint);
    assert_eq!(crawl.incremental.overlap, Duration::from_secs(300));
    assert!(crawl.links.strip.matches("utm_source") && crawl.links.strip.matches("ref"));
}

#[test]
fn heartbeat_defaults_to_a_third_of_ttl() {
    let s = Settings::from_toml("[lock]\nttl = \"9s\"", no_env).unwrap();
    assert_eq!(s.lock.heartbeat, Duration::from_secs(3));
}

#[test]
fn environment_overrides_the_file() {
    let env = |name: &str| match name {
        ENV_URI => Some("mongodb://db.example:27018".to_owned()),
        ENV_DATABASE => Some("other".to_owned()),
        ENV_INSTANCE_ID => Some("12345".to_owned()),
        _ => None,
    };
    let s = Settings::from_toml(EXAMPLE, env).unwrap();
    assert_eq!(s.mongo.uri, "mongodb://db.example:27018");
    assert_eq!(s.mongo.database, "other");
    assert_eq!(
        s.instance_id.as_str(),
        "12345",
        "a numeric id stays a string"
    );
}

/// A bot with a `[bots.crawl]` table: `scope` first, then `extra` lines.
fn crawl(extra: &str) -> String {
    let scope = if extra.starts_with("scope") {
        ""
    } else {
        "scope = [\"h:1\"]\n"
    };
    format!("[[bots]]\nid = \"a\"\nseeds = [\"http://x/\"]\n[bots.crawl]\n{scope}{extra}\n")
}

#[test]
fn bad_values_name_their_key() {
    let crawl_cases = [
        (crawl("follow = \"a[\""), "bots[0].crawl.follow"),
        (crawl("follow = [\"a\", \"$.next[\"]"), "bots[0].crawl.follow"),
        (crawl("[bots.crawl.record]\nmatch = \"/p/\"\nnatural_key = \".sku\"\nfields = { price = { css = \".p\", type = \"float\" } }"), "bots[0].crawl.record.fields.price"),
        (crawl("[bots.crawl.record]\nmatch = \"/p/\"\nnatural_key = \".sku\"\nfields = { price = { csss = \".p\" } }"), "bots[0].crawl.record.fields.price"),
        (crawl("[bots.crawl.record]\nmatch = \"/p/\"\nnatural_key = \".sku\"\nfields = { price = { css = \".p\", jsonld = \"Product\" } }"), "bots[0].crawl.record.fields.price"),
        (crawl("[bots.crawl.record]\nmatch = \"/p/\"\nnatural_key = \".sku\"\nfields = { price = { css = \".p\", required = \"yes\" } }"), "bots[0].crawl.record.fields.price"),
        (crawl("[bots.crawl.record]\nmatch = \"/p/\"\nnatural_key = { css = \".sku\", type = \"number\" }"), "bots[0].crawl.record.natural_key"),
        (crawl("follow = { css = \"a\" }"), "bots[0].crawl.follow"),
        (crawl("[bots.crawl.list]\nitem = \"$.products[*]\"\nitem_id = [\"@id\", \"@x\"]\nitem_link = \"$.url\""), "bots[0].crawl.list.item_id"),
        (crawl("[bots.crawl.list]\nitem = \"$.products[*]\"\nitem_id = []\nitem_link = \"$.url\""), "bots[0].crawl.list.item_id"),
        (crawl("[bots.crawl.list]\nitem = \".i\"\nitem_id = \"@id\"\nitem_link = \"a@href\"\nfingerprint = [\"$..[\"]"), "bots[0].crawl.list.fingerprint"),
        (crawl("[bots.crawl.record]\nmatch = \"/p/\"\nnatural_key = [\".sku\", \"$.sku\"]\nfields = { price = \"$.price.\" }"), "bots[0].crawl.record.fields.price"),
        (crawl("scope = []"), "bots[0].crawl.scope"),
        (crawl("deny = [\"(\"]"), "bots[0].crawl.deny"),
        (crawl("[bots.crawl.list]\nitem = \"..x\"\nitem_id = \"@id\"\nitem_link = \"a@href\""), "bots[0].crawl.list.item"),
        (crawl("[bots.crawl.record]\nmatch = \"/p/\"\nnatural_key = \".sku\"\nfields = { price = \"!!\" }"), "bots[0].crawl.record.fields.price"),
        (crawl("[bots.crawl.incremental]\nmode = \"sometimes\""), "bots[0].crawl.incremental.mode"),
        (crawl("headers = { \"a b\" = \"x\" }\n[bots.crawl.incremental]\nmode = \"full\""), "bots[0].crawl.headers.a b"),
        (crawl("headers = { Host = \"x\" }\n[bots.crawl.incremental]\nmode = \"full\""), "bots[0].crawl.headers.Host"),
        (crawl("headers = { X-A = \"line\\nbreak\" }\n[bots.crawl.incremental]\nmode = \"full\""), "bots[0].crawl.headers.X-A"),
        (crawl("headers = { X-Token = { env = \"SEEDLOCK_TEST_NEVER_SET\" } }\n[bots.crawl.incremental]\nmode = \"full\""), "bots[0].crawl.headers.X-Token"),
    ];
    let mut cases: Vec<(String, &str)> = crawl_cases.into_iter().collect();
    cases.extend([
        ("[lock]\nttl = \"soon\"", "lock.ttl"),
        ("[lock]\nttl = \"300000y\"\nmax_refresh = \"400000y\"", "lock.ttl"),
        ("[lock]\npoll = \"1000y\"", "lock.poll"),
        ("[mongo]\nop_timeout = \"0s\"", "mongo.op_timeout"),
        ("[crawl]\nmax_uncommitted_bytes = 100", "crawl.max_uncommitted_bytes"),
        ("[lock]\nttl = \"10s\"\nheartbeat = \"10s\"", "lock.heartbeat"),
        ("[lock]\nttl = \"10m\"\nmax_refresh = \"5m\"", "lock.max_refresh"),
        ("[mongo]\nuri = \"http://x\"", "mongo.uri"),
        ("[mongo]\ndatabase = \"a.b\"", "mongo.database"),
        ("[mongo]\nport = 1", "port"),
        ("[[bots]]\nid = \"a b\"\nseeds = [\"http://x/\"]", "bots[0].id"),
        ("[[bots]]\nid = \"a\"\nseeds = []", "bots[0].seeds"),
        ("[[bots]]\nid = \"a\"\nseeds = [\"ftp://x/\"]", "bots[0].seeds"),
        ("[[bots]]\nid = \"a\"\nseeds = [\"http://x/\"]\nrefresh = \"weekly\"", "bots[0].refresh"),
        ("[[bots]]\nid = \"a\"\nseeds = { url = \"http://x/\", format = \"csv\" }", "seeds"),
        (
            "[[bots]]\nid = \"a\"\nseeds = [\"http://x/\"]\n[[bots]]\nid = \"a\"\nseeds = [\"http://y/\"]",
            "bots[1].id",
        ),
        ("[http]\nlisten = \"nowhere\"", "http.listen"),
        ("[log]\nformat = \"xml\"", "log.format"),
    ].map(|(t, k): (&str, &str)| (t.to_owned(), k)));
    for (text, key) in &cases {
        let (text, key): (&str, &str) = (text, key);
        let err = Settings::from_toml(text, no_env).expect_err(text);
        assert!(
            err.contains(key),
            "error for {text:?} should name {key}: {err}"
        );
        assert!(!err.contains('\n'), "one line: {err}");
    }
}

#[test]
fn a_header_from_the_environment_is_sent_but_never_shown() {
    let var = "SEEDLOCK_TEST_HEADER_SECRET";
    // No other test reads or writes this variable (and nextest runs each test alone).
    std::env::set_var(var, "s3cr3t-value");
    let text = crawl(&format!(
        "headers = {{ Accept-Language = \"de\", X-Token = {{ env = \"{var}\" }} }}\n[bots.crawl.incremental]\nmode = \"full\""
    ));
    let settings = Settings::from_toml(&text, no_env).unwrap();
    let headers = &settings.bots[0].crawl.as_ref().unwrap().headers;
    assert_eq!(
        headers.shown(),
        [
            ("accept-language".to_owned(), "de".to_owned()),
            ("x-token".to_owned(), format!("<from ${var}>")),
        ]
    );
    let debug = format!("{:?}", settings.bots[0]);
    assert!(!debug.contains("s3cr3t-value"), "{debug}");
    assert!(debug.contains(&format!("<from ${var}>")), "{debug}");
}

#[test]
fn a_bad_uri_is_reported_without_its_password() {
    let err =
        Settings::from_toml("[mongo]\nuri = \"postgres://u:hunter2@h/db\"", no_env).unwrap_err();
    assert!(!err.contains("hunter2"), "{err}");
}

#[test]
fn selector_tables_name_where_a_value_is_and_how_a_field_reads_it() {
    let text = crawl(
        "[bots.crawl.list]\nitem = [\".item\", \"$.products[*]\"]\nitem_id = [\"@data-id\", \"$.id\"]\nitem_link = { css = \"a@href\" }\nfingerprint = [\".price\", { jsonld = \"Product\", path = \"$.offers.price\" }, \"$.price\"]\n[bots.crawl.record]\nmatch = \"/p/\"\nnatural_key = { css = \"script#__NEXT_DATA__\", path = \"$.props.sku\" }\nfields = { price = [{ jsonld = \"Product\", path = \"$.offers.price\", type = \"number\", required = true }, { path = \"$.price\", type = \"number\", required = true }], tags = { css = \".tag\", all = true }, title = \"h1\" }",
    );
    let settings = Settings::from_toml(&text, |_| None).unwrap();
    let crawl = settings.bots[0].crawl.as_ref().unwrap();
    let list = crawl.list.as_ref().unwrap();
    assert!(list.item.html.is_some() && list.item.json.is_some());
    assert_eq!(list.fingerprint.len(), 2, "the HTML entries");
    assert_eq!(list.fingerprint_json.len(), 1, "the JSONPath entry");
    let record = crawl.record.as_ref().unwrap();
    assert!(matches!(
        record.natural_key.html,
        Some(crate::extract::HtmlRead::InElement { .. })
    ));
    let price = &record.fields["price"];
    assert!(matches!(
        price.pick.html,
        Some(crate::extract::HtmlRead::JsonLd { .. })
    ));
    assert!(price.pick.json.is_some());
    assert_eq!(
        (price.ty, price.all, price.required),
        (Some(crate::extract::ValueType::Number), false, true)
    );
    let tags = &record.fields["tags"];
    assert_eq!((tags.ty, tags.all, tags.required), (None, true, false));
    let title = &record.fields["title"];
    assert_eq!((title.ty, title.all, title.required), (None, false, false));
}
