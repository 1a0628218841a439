/**
 * Lone UTF-16 surrogates. JSON can carry them (`"a\ud800b"` parses), but they are not text: UTF-8
 * cannot encode them, and RFC 8785 canonical JSON — the bytes receipts hash and sign — refuses
 * them. A request holding one is refused where it enters (400 naming the field), so everything
 * accepted can be hashed and receipted.
 */

/** Matches an unpaired surrogate (with the `u` flag a valid pair is one code point and does not match). */
const LONE_SURROGATE = /[\uD800-\uDFFF]/u

/**
 * The path of the first string (or object key) in `value` holding a lone surrogate, in OpenAI's
 * `param` notation (`messages[0].content`), or undefined when every string is well formed.
 */
export function findLoneSurrogate (value: unknown, path = ''): string | undefined {
  if (typeof value === 'string') return LONE_SURROGATE.test(value) ? path : undefined
  if (Array.isArray(value)) {
    for (let i = 0; i < value.length; i++) {
      const found = findLoneSurrogate(value[i], `${path}[${i}]`)
      if (found !== undefined) return found
    }
    return undefined
  }
  if (typeof value === 'object' && value !== null) {
    for (const [k, v] of Object.entries(value)) {
      const at = path === '' ? k : `${path}.${k}`
      if (LONE_SURROGATE.test(k)) return at
      const found = findLoneSurrogate(v, at)
      if (found !== undefined) return found
    }
  }
  return undefined
}
