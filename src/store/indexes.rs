//! seedlock's own indexes, kept as this version defines them at every start-up: a missing one is
//! built, one whose definition under the same name changed (its keys, its partial filter, its
//! expiry) is dropped and built again — MongoDB refuses to create a changed definition under an
//! existing name (codes 85 and 86) — and those of earlier versions (the collection's retired
//! names) are dropped. Each rebuild and drop is one log line. An operator's own indexes (other
//! names) are left alone, and one with exactly the definition of one of seedlock's under another
//! name is adopted: used as it is, logged, never dropped (MongoDB refuses a second index of the
//! same definition, code 85). An index that cannot be built is one line naming the collection,
//! the index and the server's message.
//!
//! Through a rolling upgrade, instances of two versions run side by side. Each instance records
//! in its registration (`instances.indexes`) the definitions it uses, so a drop — of a retired
//! index or of a changed definition — waits while a live instance of another version still uses
//! the index as it is: it is logged once, kept, and done on a later instance heartbeat once that
//! instance has stopped.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Duration;

use bson::{doc, Bson, Document};
use futures_util::TryStreamExt;
use mongodb::options::IndexOptions;
use mongodb::IndexModel;

use super::Store;
use crate::error::Result;

/// One index as this version wants it.
#[derive(Clone, Debug)]
pub(crate) struct IndexDef {
    pub name: &'static str,
    pub keys: Document,
    /// Only the documents this filter matches are in the index.
    pub partial: Option<Document>,
    /// A TTL index: documents expire this long after the indexed date.
    pub expire_after: Option<Duration>,
    /// No two documents share its keys.
    pub unique: bool,
}

impl IndexDef {
    pub(crate) fn new(name: &'static str, keys: Document) -> IndexDef {
        IndexDef {
            name,
            keys,
            partial: None,
            expire_after: None,
            unique: false,
        }
    }

    fn model(&self) -> IndexModel {
        IndexModel::builder()
            .keys(self.keys.clone())
            .options(
                IndexOptions::builder()
                    .name(self.name.to_owned())
                    .partial_filter_expression(self.partial.clone())
                    .expire_after(self.expire_after)
                    .unique(self.unique.then_some(true))
                    .build(),
            )
            .build()
    }

    /// Whether `existing` (as the server lists it) is this definition.
    fn is(&self, existing: &IndexModel) -> bool {
        same_definition(
            &self.keys,
            self.partial.as_ref(),
            self.expire_after,
            self.unique,
            existing,
        )
    }

    /// This definition as an instance's registration records it (`instances.indexes`), in the
    /// shape `listIndexes` prints.
    fn recorded(&self, collection: &str) -> Document {
        let mut d = doc! { "collection": collection, "name": self.name, "key": self.keys.clone() };
        if let Some(partial) = &self.partial {
            d.insert("partialFilterExpression", partial.clone());
        }
        if let Some(expire) = self.expire_after {
            d.insert(
                "expireAfterSeconds",
                i64::try_from(expire.as_secs()).unwrap_or(i64::MAX),
            );
        }
        if self.unique {
            d.insert("unique", true);
        }
        d
    }

    /// Whether an operator's index `existing`, under another name, serves as this one: the same
    /// definition, and nothing that changes what it accepts or whether queries use it (unique,
    /// sparse, hidden, a collation) — with any of those MongoDB builds seedlock's beside it.
    fn adoptable(&self, existing: &IndexModel) -> bool {
        let plain = existing.options.as_ref().is_none_or(|o| {
            o.unique != Some(true)
                && o.sparse != Some(true)
                && o.hidden != Some(true)
                && o.collation.is_none()
        });
        plain && !self.unique && self.is(existing)
    }
}

fn same_definition(
    keys: &Document,
    partial: Option<&Document>,
    expire_after: Option<Duration>,
    unique: bool,
    existing: &IndexModel,
) -> bool {
    let options = existing.options.as_ref();
    same_keys(keys, &existing.keys)
        && options.and_then(|o| o.partial_filter_expression.as_ref()) == partial
        && options.and_then(|o| o.expire_after) == expire_after
        && options.and_then(|o| o.unique).unwrap_or(false) == unique
}

/// Whether `existing` is the definition an instance recorded as `recorded` (see
/// [`IndexDef::recorded`]).
fn recorded_is(recorded: &Document, existing: &IndexModel) -> bool {
    let Ok(keys) = recorded.get_document("key") else {
        return false;
    };
    let expire_after = match recorded.get("expireAfterSeconds") {
        None => None,
        Some(v) => match crate::store::document::integer(v).and_then(|s| u64::try_from(s).ok()) {
            Some(secs) => Some(Duration::from_secs(secs)),
            None => return false,
        },
    };
    same_definition(
        keys,
        recorded.get_document("partialFilterExpression").ok(),
        expire_after,
        recorded.get_bool("unique").unwrap_or(false),
        existing,
    )
}

/// A collection's wanted definitions and retired names.
type CollectionIndexes = (Vec<IndexDef>, Vec<&'static str>);

/// The indexes this process uses (recorded in its instance registration) and the drops it put
/// off for a live instance of another version, shared by every clone of a store.
#[derive(Debug, Default)]
pub(crate) struct IndexSet {
    /// Each collection's definitions, as this version wants them.
    in_use: Mutex<BTreeMap<String, Vec<IndexDef>>>,
    /// Collections with a drop put off, and the names they retire.
    deferred: Mutex<BTreeMap<String, CollectionIndexes>>,
    /// Indexes whose drop was put off and said so (once each).
    said: Mutex<BTreeSet<(String, String)>>,
    /// The server refused a `commitQuorum` (a standalone): later builds go without one.
    no_quorum: std::sync::atomic::AtomicBool,
}

impl IndexSet {
    /// Every definition this process uses, as its registration records them.
    pub(crate) fn recorded(&self) -> Vec<Bson> {
        let in_use = self.in_use.lock().unwrap_or_else(|e| e.into_inner());
        in_use
            .iter()
            .flat_map(|(collection, defs)| {
                defs.iter().map(|d| Bson::Document(d.recorded(collection)))
            })
            .collect()
    }

    /// Whether a drop waits for an instance of another version to stop.
    pub(crate) fn has_deferred(&self) -> bool {
        !self
            .deferred
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }
}

/// Does the drops put off for a live instance of another version whose instance has stopped
/// since (the instance heartbeat calls this while any wait). Those still needed stay put off.
pub(crate) async fn finish_deferred(store: &Store) -> Result<()> {
    let pending: Vec<(String, CollectionIndexes)> = store
        .index_set()
        .deferred
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(c, w)| (c.clone(), w.clone()))
        .collect();
    for (collection, (wanted, retired)) in pending {
        ensure(store, &collection, &wanted, &retired).await?;
    }
    Ok(())
}

/// Key patterns compare by field and direction: a server may list `1` as an `Int32`, an `Int64`
/// or a `Double`.
fn same_keys(a: &Document, b: &Document) -> bool {
    let direction = |v: &Bson| match v {
        Bson::Int32(n) => Some(f64::from(*n)),
        Bson::Int64(n) => Some(*n as f64),
        Bson::Double(n) => Some(*n),
        _ => None,
    };
    a.len() == b.len()
        && a.iter()
            .zip(b.iter())
            .all(|((ka, va), (kb, vb))| ka == kb && direction(va) == direction(vb))
}

/// Makes `collection`'s indexes named in `wanted` exactly those definitions, and drops those
/// named in `retired` (see the module comment). Idempotent: a second call changes nothing.
/// Instances starting together on a fresh database build the same indexes at once; a build the
/// server aborted or found in progress for another of them is looked at again, from the list.
pub(crate) async fn ensure(
    store: &Store,
    collection: &str,
    wanted: &[IndexDef],
    retired: &[&'static str],
) -> Result<()> {
    let set = store.index_set();
    set.in_use
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(collection.to_owned(), wanted.to_vec());
    let mut attempt = 0;
    loop {
        match ensure_once(store, collection, wanted, retired).await {
            Ok(kept) => {
                let mut deferred = set.deferred.lock().unwrap_or_else(|e| e.into_inner());
                if kept {
                    deferred.insert(collection.to_owned(), (wanted.to_vec(), retired.to_vec()));
                } else {
                    deferred.remove(collection);
                }
                return Ok(());
            }
            Err(crate::error::Error::Db(e)) if concurrent_build(&e) && attempt < 5 => {
                attempt += 1;
                tracing::debug!(collection, error = %e, attempt, "another instance builds the same index; looking again");
                tokio::time::sleep(crate::backoff::full_jitter(
                    Duration::from_millis(100),
                    Duration::from_secs(2),
                    attempt,
                ))
                .await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Builds `create` on `collection` in one `createIndexes` (one round trip for a fresh
/// database's indexes, not one each). A batch the server refuses for another reason than a
/// restart or a concurrent build is built again one index at a time, so that the refusal names
/// its index.
async fn build_all(
    store: &Store,
    coll: &mongodb::Collection<Document>,
    collection: &str,
    create: Vec<IndexModel>,
) -> Result<()> {
    match build(store, coll, create.clone()).await {
        Err(crate::error::Error::Db(db)) if refused(&db) => {
            for index in create {
                let name = index
                    .options
                    .as_ref()
                    .and_then(|o| o.name.clone())
                    .unwrap_or_default();
                build(store, coll, vec![index]).await.map_err(|e| match e {
                    // What the server refuses is said once, plainly; a server restarting or
                    // stepping down is retried by the start-up's patience.
                    crate::error::Error::Db(db) if refused(&db) => crate::error::Error::Index {
                        collection: collection.to_owned(),
                        index: name,
                        message: server_message(&db),
                    },
                    other => other,
                })?;
            }
            Ok(())
        }
        other => other,
    }
}

/// What the server refused for good: not a restart or a step-down (the start-up's patience
/// retries those) nor another instance's build of the same index.
fn refused(e: &mongodb::error::Error) -> bool {
    !crate::error::is_transient_db(e) && !concurrent_build(e)
}

/// One `createIndexes` of `indexes`, committed by a majority of the voting members, not every
/// one (the server's default: a member that is down would hold start-up until it came back) —
/// or without a quorum on a standalone, which takes none (remembered: asked once per process).
async fn build(
    store: &Store,
    coll: &mongodb::Collection<Document>,
    indexes: Vec<IndexModel>,
) -> Result<()> {
    use std::sync::atomic::Ordering;
    let no_quorum = &store.indexes.no_quorum;
    if !no_quorum.load(Ordering::Relaxed) {
        let with_quorum = coll
            .create_indexes(indexes.clone())
            .commit_quorum(mongodb::options::CommitQuorum::Majority);
        match store.index_build("create indexes", with_quorum).await {
            Err(crate::error::Error::Db(e)) if quorum_refused(&e) => {
                no_quorum.store(true, Ordering::Relaxed);
            }
            other => return other.map(|_| ()),
        }
    }
    store
        .index_build("create indexes", coll.create_indexes(indexes))
        .await
        .map(|_| ())
}

/// A server that takes no `commitQuorum` (a standalone): BadValue (2) or InvalidOptions (72)
/// about it.
fn quorum_refused(e: &mongodb::error::Error) -> bool {
    matches!(e.kind.as_ref(), mongodb::error::ErrorKind::Command(c)
        if matches!(c.code, 2 | 72) && c.message.contains("commitQuorum"))
}

/// IndexBuildAborted (276), IndexBuildAlreadyInProgress (384): another instance's build of the
/// same index got there first.
fn concurrent_build(e: &mongodb::error::Error) -> bool {
    matches!(code_of(e), Some(276 | 384))
}

/// One look at `collection`'s indexes and the changes it calls for. True if a drop was put off
/// for a live instance of another version.
async fn ensure_once(
    store: &Store,
    collection: &str,
    wanted: &[IndexDef],
    retired: &[&str],
) -> Result<bool> {
    let coll = store.database().collection::<Document>(collection);
    let existing: Vec<IndexModel> = store
        .bounded("list indexes", async {
            coll.list_indexes().await?.try_collect().await
        })
        .await
        // A collection that does not exist yet has no indexes.
        .or_else(|e| match &e {
            crate::error::Error::Db(db) if is_namespace_not_found(db) => Ok(Vec::new()),
            _ => Err(e),
        })?;
    let named = |name: &str| {
        existing
            .iter()
            .find(|i| i.options.as_ref().and_then(|o| o.name.as_deref()) == Some(name))
    };
    // An operator's index (not one of seedlock's names, current or retired) that serves as
    // `index`.
    let adoptable = |index: &IndexDef| {
        existing.iter().find(|i| {
            let name = i.options.as_ref().and_then(|o| o.name.as_deref());
            name.is_none_or(|n| !retired.contains(&n) && !wanted.iter().any(|w| w.name == n))
                && index.adoptable(i)
        })
    };
    let mut kept = false;
    let mut create = Vec::new();
    for index in wanted {
        match named(index.name) {
            Some(found) if index.is(found) => {}
            Some(found) if still_used(store, collection, index.name, found).await? => kept = true,
            None if adoptable(index).is_some() => {
                let theirs = adoptable(index);
                tracing::info!(
                    collection,
                    index = index.name,
                    adopted = theirs
                        .and_then(|i| i.options.as_ref())
                        .and_then(|o| o.name.as_deref())
                        .unwrap_or("?"),
                    "an index of another name has this definition: using it, as it is"
                );
            }
            Some(found) => {
                tracing::info!(
                    collection,
                    index = index.name,
                    was = %found.keys,
                    "rebuilding an index whose definition changed in this version"
                );
                store
                    .index_build("drop a changed index", coll.drop_index(index.name))
                    .await
                    .or_else(gone)?;
                create.push(index.model());
            }
            None => create.push(index.model()),
        }
    }
    if !create.is_empty() {
        build_all(store, &coll, collection, create).await?;
    }
    for name in retired {
        let Some(found) = named(name) else { continue };
        if still_used(store, collection, name, found).await? {
            kept = true;
        } else {
            store
                .index_build("drop a retired index", coll.drop_index(*name))
                .await
                .or_else(gone)?;
            tracing::info!(
                collection,
                index = *name,
                "dropped an index this version does not use"
            );
        }
    }
    Ok(kept)
}

/// Whether a live instance (its registration not expired, by the server's clock) recorded that
/// it uses `existing`, `collection`'s index `name`, as it is: its drop waits. Said once per index.
async fn still_used(
    store: &Store,
    collection: &str,
    name: &str,
    existing: &IndexModel,
) -> Result<bool> {
    let instances = store
        .database()
        .collection::<Document>(super::instances::INSTANCES);
    let filter = doc! {
        "indexes": { "$elemMatch": { "collection": collection, "name": name } },
        "$expr": { "$gt": ["$expiresAt", "$$NOW"] },
    };
    let users: Vec<Document> = store
        .bounded("read the indexes instances use", async {
            instances
                .find(filter)
                .projection(doc! { "indexes": 1, "version": 1 })
                .await?
                .try_collect()
                .await
        })
        .await?;
    let user = users.iter().find(|d| {
        d.get_array("indexes").is_ok_and(|recorded| {
            recorded.iter().any(|r| {
                r.as_document().is_some_and(|r| {
                    r.get_str("collection") == Ok(collection)
                        && r.get_str("name") == Ok(name)
                        && recorded_is(r, existing)
                })
            })
        })
    });
    let Some(user) = user else { return Ok(false) };
    let first = store
        .index_set()
        .said
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert((collection.to_owned(), name.to_owned()));
    if first {
        tracing::info!(
            collection,
            index = name,
            instance = %user.get("_id").map_or_else(|| "?".to_owned(), ToString::to_string),
            version = user.get_str("version").unwrap_or("?"),
            "kept an index a running instance of another version still uses; it is changed once that instance stops"
        );
    }
    Ok(true)
}

/// An index already gone (another instance, upgraded at the same moment, dropped it first) is as
/// good as dropped.
fn gone(e: crate::error::Error) -> Result<()> {
    match &e {
        crate::error::Error::Db(db) if index_not_found(db) => Ok(()),
        _ => Err(e),
    }
}

/// The server's own message for a command it refused (`errmsg`, with its code name), else the
/// driver's one-line account.
fn server_message(e: &mongodb::error::Error) -> String {
    match e.kind.as_ref() {
        mongodb::error::ErrorKind::Command(c) => format!("{} ({})", c.message, c.code_name),
        _ => super::one_line(&e.to_string()),
    }
}

fn code_of(e: &mongodb::error::Error) -> Option<i32> {
    match e.kind.as_ref() {
        mongodb::error::ErrorKind::Command(c) => Some(c.code),
        _ => None,
    }
}

/// IndexNotFound (27).
fn index_not_found(e: &mongodb::error::Error) -> bool {
    code_of(e) == Some(27)
}

/// NamespaceNotFound (26).
fn is_namespace_not_found(e: &mongodb::error::Error) -> bool {
    code_of(e) == Some(26)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;

    #[test]
    fn key_patterns_compare_by_field_and_direction_whatever_the_number_type() {
        assert!(same_keys(
            &doc! { "a": 1, "b": -1 },
            &doc! { "a": 1_i64, "b": -1.0 }
        ));
        assert!(!same_keys(
            &doc! { "a": 1, "b": 1 },
            &doc! { "b": 1, "a": 1 }
        ));
        assert!(!same_keys(&doc! { "a": 1 }, &doc! { "a": 1, "b": 1 }));
        assert!(!same_keys(&doc! { "a": 1 }, &doc! { "a": -1 }));
    }
}
