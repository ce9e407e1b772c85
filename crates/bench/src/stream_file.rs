//! The exported event stream: u64 little-endian records, so that other indexes can replay it.
//! - Stored without parent: `[0, w, event_id, k, (engine hash, local hash) × k]`
//! - Stored with parent:    `[1, w, event_id, parent, k, (engine hash, local hash) × k]`
//! - Removed:               `[2, w, event_id, k, engine hash × k]`
//!
//! Every event is for dp_rank 0; `Cleared` never appears in this stream.

use kvrouter_protocol::{
    EngineBlockHash, KvEvent, KvEventData, LocalBlockHash, StoredBlock, Tier, WorkerKey,
};
use std::io::{self, Read, Write};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum StreamFileError {
    #[error("stream i/o: {0}")]
    Io(#[from] io::Error),
    #[error("stream record at word {word}: unknown tag {tag}")]
    BadTag { word: u64, tag: u64 },
    #[error("stream record at word {word}: truncated")]
    Truncated { word: u64 },
    #[error("event for dp_rank {0} cannot be exported (the stream format has none)")]
    NotExportable(u32),
}

pub fn write_event<W: Write>(out: &mut W, ev: &KvEvent) -> Result<(), StreamFileError> {
    if ev.key.dp_rank != 0 {
        return Err(StreamFileError::NotExportable(ev.key.dp_rank));
    }
    let mut put = |v: u64| out.write_all(&v.to_le_bytes());
    let (w, id) = (ev.key.worker_id, ev.event_id);
    match &ev.data {
        KvEventData::Stored { parent, blocks } => {
            match parent {
                None => [0, w, id].into_iter().try_for_each(&mut put)?,
                Some(p) => [1, w, id, p.0].into_iter().try_for_each(&mut put)?,
            }
            put(blocks.len() as u64)?;
            for b in blocks {
                put(b.engine_hash.0)?;
                put(b.local_hash.0)?;
            }
        }
        KvEventData::Removed { engine_hashes } => {
            [2, w, id, engine_hashes.len() as u64]
                .into_iter()
                .try_for_each(&mut put)?;
            for e in engine_hashes {
                put(e.0)?;
            }
        }
        KvEventData::Cleared => {
            return Err(StreamFileError::NotExportable(u32::MAX));
        }
    }
    Ok(())
}

/// Reads events one at a time, never holding more than one.
pub struct StreamFileReader<R> {
    input: R,
    word: u64,
    spare_blocks: Vec<StoredBlock>,
    spare_hashes: Vec<EngineBlockHash>,
}

impl<R: Read> StreamFileReader<R> {
    pub fn new(input: R) -> Self {
        Self {
            input,
            word: 0,
            spare_blocks: Vec::new(),
            spare_hashes: Vec::new(),
        }
    }

    /// Hands an event's buffers back for the next decode, so that a long stream is read with
    /// no allocation per event.
    pub fn recycle(&mut self, ev: KvEvent) {
        match ev.data {
            KvEventData::Stored { mut blocks, .. } => {
                blocks.clear();
                self.spare_blocks = blocks;
            }
            KvEventData::Removed { mut engine_hashes } => {
                engine_hashes.clear();
                self.spare_hashes = engine_hashes;
            }
            KvEventData::Cleared => {}
        }
    }

    fn word(&mut self, start: u64) -> Result<u64, StreamFileError> {
        let mut buf = [0u8; 8];
        self.input
            .read_exact(&mut buf)
            .map_err(|e| match e.kind() {
                io::ErrorKind::UnexpectedEof => StreamFileError::Truncated { word: start },
                _ => StreamFileError::Io(e),
            })?;
        self.word += 1;
        Ok(u64::from_le_bytes(buf))
    }

    /// The next event, or `None` at a clean end of stream.
    pub fn next_event(&mut self) -> Result<Option<KvEvent>, StreamFileError> {
        let start = self.word;
        let mut first = [0u8; 8];
        match self.input.read(&mut first[..1])? {
            0 => return Ok(None),
            _ => self
                .input
                .read_exact(&mut first[1..])
                .map_err(|_| StreamFileError::Truncated { word: start })?,
        }
        self.word += 1;
        let tag = u64::from_le_bytes(first);
        if tag > 2 {
            return Err(StreamFileError::BadTag { word: start, tag });
        }
        let w = self.word(start)?;
        let event_id = self.word(start)?;
        let parent = if tag == 1 {
            Some(EngineBlockHash(self.word(start)?))
        } else {
            None
        };
        let k = self.word(start)?;
        // k is untrusted: grow as records arrive instead of reserving k up front.
        let data = if tag == 2 {
            let mut engine_hashes = std::mem::take(&mut self.spare_hashes);
            engine_hashes.reserve(k.min(4096) as usize);
            for _ in 0..k {
                engine_hashes.push(EngineBlockHash(self.word(start)?));
            }
            KvEventData::Removed { engine_hashes }
        } else {
            let mut blocks = std::mem::take(&mut self.spare_blocks);
            blocks.reserve(k.min(4096) as usize);
            for _ in 0..k {
                let engine_hash = EngineBlockHash(self.word(start)?);
                let local_hash = LocalBlockHash(self.word(start)?);
                blocks.push(StoredBlock {
                    engine_hash,
                    local_hash,
                });
            }
            KvEventData::Stored { parent, blocks }
        };
        Ok(Some(KvEvent {
            tier: Tier::Device,
            key: WorkerKey::new(w, 0),
            event_id,
            data,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_layout() {
        let events = vec![
            KvEvent {
                tier: Tier::Device,
                key: WorkerKey::new(3, 0),
                event_id: 0,
                data: KvEventData::Stored {
                    parent: None,
                    blocks: vec![StoredBlock {
                        engine_hash: EngineBlockHash(10),
                        local_hash: LocalBlockHash(11),
                    }],
                },
            },
            KvEvent {
                tier: Tier::Device,
                key: WorkerKey::new(3, 0),
                event_id: 1,
                data: KvEventData::Stored {
                    parent: Some(EngineBlockHash(10)),
                    blocks: vec![],
                },
            },
            KvEvent {
                tier: Tier::Device,
                key: WorkerKey::new(4, 0),
                event_id: 0,
                data: KvEventData::Removed {
                    engine_hashes: vec![EngineBlockHash(10), EngineBlockHash(12)],
                },
            },
        ];
        let mut buf = vec![];
        for e in &events {
            write_event(&mut buf, e).unwrap();
        }
        let words: Vec<u64> = buf
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(
            words,
            vec![0, 3, 0, 1, 10, 11, 1, 3, 1, 10, 0, 2, 4, 0, 2, 10, 12]
        );
        let mut r = StreamFileReader::new(&buf[..]);
        for e in &events {
            assert_eq!(r.next_event().unwrap().as_ref(), Some(e));
        }
        assert!(r.next_event().unwrap().is_none());
        // truncation and bad tags are typed errors
        let mut r = StreamFileReader::new(&buf[..buf.len() - 3]);
        let mut last = Ok(None);
        for _ in 0..3 {
            last = r.next_event();
        }
        assert!(matches!(last, Err(StreamFileError::Truncated { word: 11 })));
        let bad = 7u64.to_le_bytes();
        assert!(matches!(
            StreamFileReader::new(&bad[..]).next_event(),
            Err(StreamFileError::BadTag { tag: 7, .. })
        ));
    }
}
