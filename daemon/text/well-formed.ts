/**
 * Lone UTF-16 surrogates. JSON can carry them (`"a\ud800b"` parses), but they are not text: UTF-8
 * cannot encode them, and RFC 8785 canonical JSON — the bytes receipts hash and sign — refuses
 * them. A request holding one is refused where it enters (400 naming the field), so everything
 * accepted can be hashed and receipted.
 */

/**
 * The path of the first string (or object key) in `value` holding a lone surrogate, in OpenAI's
 * `param` notation (`messages[0].content`), or undefined when every string is well formed.
 * Iterative (an explicit stack, depth-first in document order): a body nested a million arrays
 * deep must not overflow the call stack.
 */
export function findLoneSurrogate (value: unknown, path = ''): string | undefined {
  const stack: Array<[unknown, string]> = [[value, path]]
  while (stack.length > 0) {
    const [v, at] = stack.pop()!
    // isWellFormed: native, ~8x faster than a /[\uD800-\uDFFF]/u scan on two-byte strings.
    if (typeof v === 'string') {
      if (!v.isWellFormed()) return at
    } else if (Array.isArray(v)) {
      // Only what can hold a string is visited (and given its path): a token-id prompt's numbers
      // are skipped, where each cost a path string and a stack entry (three scans a request).
      for (let i = v.length - 1; i >= 0; i--) if (mayHoldText(v[i])) stack.push([v[i], `${at}[${i}]`])
    } else if (typeof v === 'object' && v !== null) {
      const entries = Object.entries(v)
      for (let i = entries.length - 1; i >= 0; i--) {
        const [k, x] = entries[i]!
        const child = at === '' ? k : `${at}.${k}`
        if (!k.isWellFormed()) return child
        if (mayHoldText(x)) stack.push([x, child])
      }
    }
  }
  return undefined
}

const mayHoldText = (v: unknown): boolean => typeof v === 'string' || (typeof v === 'object' && v !== null)
