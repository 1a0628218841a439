/**
 * Streaming detokenization. Decoding token by token can split a multi-byte UTF-8 character (byte
 * fallback, byte-level BPE) or change earlier text (SentencePiece's leading-space handling), so we
 * decode a small window twice — with and without the newest tokens — and emit only the growth,
 * and only once it no longer ends in U+FFFD (an incomplete character).
 */

export interface Decoder {
  decode (ids: number[]): string
}

export interface StreamingDetokenizer {
  /** Add one token; returns text that is now stable ('' when still waiting). */
  push (id: number): string
  /** End of stream: everything not yet emitted, incomplete characters included. */
  flush (): string
}

const REPLACEMENT = '\uFFFD'

/**
 * A decoder that remembers what it decoded for windows of up to `maxIds` ids (a streaming
 * detokenizer's windows are one to three tokens: every token is decoded again as the left context
 * of the next one). Decoding is a pure function of the ids, so a remembered string is exact.
 * tokenizers.js decodes a window through its decoder chain and a TextDecoder, twice a token on the
 * thread that streams every token: 3.3–5.4 µs a token in a tight loop, 0.63 when the windows
 * repeat (docs/engine-notes.md, wave 10), and several times that on a server's busy main thread.
 * `maxEntries` bounds the memory (all forgotten at once when full: windows repeat within a
 * stretch of text, so the next ones refill it).
 */
export function memoizedDecoder (decoder: Decoder, { maxIds = 3, maxEntries = 8192 } = {}): Decoder {
  const memo = new Map<string, string>()
  return {
    decode (ids) {
      if (ids.length > maxIds) return decoder.decode(ids)
      const key = ids.join(',')
      let text = memo.get(key)
      if (text === undefined) {
        text = decoder.decode(ids)
        if (memo.size >= maxEntries) memo.clear()
        memo.set(key, text)
      }
      return text
    },
  }
}

export function createStreamingDetokenizer (decoder: Decoder): StreamingDetokenizer {
  const ids: number[] = []
  // ids[prefix, read) were emitted and are decoded again only as left context.
  let prefix = 0
  let read = 0
  const pending = (): string => {
    const before = decoder.decode(ids.slice(prefix, read))
    const after = decoder.decode(ids.slice(prefix))
    return after.length > before.length ? after.slice(before.length) : ''
  }
  return {
    push (id) {
      ids.push(id)
      const text = pending()
      if (text.length === 0 || text.endsWith(REPLACEMENT)) return ''
      prefix = read
      read = ids.length
      return text
    },
    flush () {
      const text = pending()
      prefix = read = ids.length
      return text
    },
  }
}
