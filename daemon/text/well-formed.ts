/**
 * Lone UTF-16 surrogates. JSON can carry them (`"a\ud800b"` parses), but they are not text: UTF-8
 * cannot encode them, and RFC 8785 canonical JSON — the bytes receipts hash and sign — refuses
 * them. A request holding one is refused where it enters (400 naming the field), so everything
 * accepted can be hashed and receipted.
 */


/**
 * The path of the first string (or object key) in `value` holding a lone surrogate, in OpenAI's
 * `param` notation (`messages[0].content`), or undefined when every string is well formed.
 */
export function findLoneSurrogate (value: unknown, path = ''): string | undefined {
  // isWellFormed: native, ~8x faster than a /[\uD800-\uDFFF]/u scan on two-byte strings.
  if (typeof value === 'string') return value.isWellFormed() ? undefined : path
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
      if (!k.isWellFormed()) return at
      const found = findLoneSurrogate(v, at)
      if (found !== undefined) return found
    }
  }
  return undefined
}
