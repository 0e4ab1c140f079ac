//! The known-items read: what the frontier remembers of a page from an earlier pass (its
//! validators, its record id, its fingerprint), read by id.

use super::*;

/// What the frontier remembers of a URL from any pass (the incremental modes decide from it
/// whether a detail page needs fetching; an enqueue, whether to insert or reset it).
#[derive(Clone, Debug, PartialEq)]
pub struct KnownPage {
    pub pass: PassNumber,
    pub status: Option<UrlStatus>,
    /// The listing fingerprint the page was last stored with.
    pub fingerprint: Option<String>,
    pub record_id: Option<String>,
    pub validators: Validators,
    /// Links followed from a seed to reach it when it was last enqueued (0 when not stored).
    pub depth: u32,
}

impl KnownPage {
    /// The fields a read of known pages projects (with `extra`).
    pub(crate) fn projection(extra: &[&str]) -> Document {
        let mut projection = doc! {
            f::PASS: 1, f::STATUS: 1, f::FINGERPRINT: 1, f::RECORD_ID: 1, f::ETAG: 1,
            f::LAST_MODIFIED: 1, f::DEPTH: 1,
        };
        for name in extra {
            projection.insert(*name, 1);
        }
        projection
    }

    /// What an entry read raw with [`KnownPage::projection`] holds (a field that does not read
    /// is missing).
    pub(crate) fn from_raw(entry: &bson::RawDocument) -> KnownPage {
        Document::try_from(entry).map_or_else(
            |_| KnownPage::from_doc(&Document::new()),
            |doc| KnownPage::from_doc(&doc),
        )
    }

    fn from_doc(doc: &Document) -> KnownPage {
        KnownPage {
            pass: get_int(doc, f::PASS).map_or(PassNumber::NONE, PassNumber::new),
            status: doc.get_str(f::STATUS).ok().and_then(UrlStatus::parse),
            fingerprint: get_text(doc, f::FINGERPRINT),
            record_id: get_text(doc, f::RECORD_ID),
            depth: depth_of(doc),
            validators: Validators {
                etag: get_text(doc, f::ETAG),
                last_modified: get_text(doc, f::LAST_MODIFIED),
            },
        }
    }
}

impl Frontier<'_> {
    /// What the frontier knows of these URLs from any pass, by frontier `_id`.
    pub async fn known_pages(
        self,
        bot: &BotId,
        urls: &[&NormalizedUrl],
    ) -> Result<HashMap<String, KnownPage>> {
        let ids: Vec<String> = urls.iter().map(|u| url_id(bot, u)).collect();
        self.known_by_id(bot, &ids).await
    }

    /// As [`Frontier::known_pages`], by frontier `_id`.
    pub async fn known_by_id(
        self,
        bot: &BotId,
        ids: &[String],
    ) -> Result<HashMap<String, KnownPage>> {
        let mut known = HashMap::new();
        for chunk in ids.chunks(CHUNK) {
            let found: Vec<Document> = self
                .store
                .bounded("read known pages", async {
                    self.store
                        .frontier()
                        .collection()
                        .find(doc! { f::ID: { "$in": chunk }, f::BOT: bot.as_str() })
                        .projection(KnownPage::projection(&[]))
                        .batch_size(whole_batch(chunk.len()))
                        .await?
                        .try_collect()
                        .await
                })
                .await?;
            for doc in found {
                if let Some(id) = get_text(&doc, f::ID) {
                    known.insert(id, KnownPage::from_doc(&doc));
                }
            }
        }
        Ok(known)
    }
}
