/**
 * Stop strings over a stream of text. Text that might be the start of a stop string is held back
 * until it is known not to be one, so a stop string never reaches the client, even in part.
 * Generation stops at the first stop string to be completed as the text arrives (as vLLM and
 * OpenAI stop): a longer stop string that began earlier but would complete later never gets to.
 */

export interface StopPush {
  /** Text now safe to emit. */
  text: string
  /** A stop string was found; `text` is everything before it and the stream is over. */
  stopped: boolean
}

export interface StopMatcher {
  push (text: string): StopPush
  /** End of stream without a stop: whatever was held back is safe now. */
  flush (): string
}

export function createStopMatcher (stops: readonly string[]): StopMatcher {
  const list = stops.filter(s => s.length > 0)
  let held = ''
  let done = false
  return {
    push (text) {
      if (done) return { text: '', stopped: true }
      if (list.length === 0) return { text, stopped: false }
      held += text
      const at = earliestStop(held, list)
      if (at >= 0) {
        done = true
        const out = held.slice(0, at)
        held = ''
        return { text: out, stopped: true }
      }
      const keep = heldSuffixLength(held, list)
      const out = held.slice(0, held.length - keep)
      held = held.slice(held.length - keep)
      return { text: out, stopped: false }
    },
    flush () {
      const out = done ? '' : held
      held = ''
      return out
    },
  }
}

/**
 * Where the text is cut for the stop string that completes first in `text` (the smallest end;
 * of two ending together, the one that starts first), or -1 when none occurs. Whatever the text's
 * chunking, this is the stop that reading it one character at a time would meet first.
 */
export function earliestStop (text: string, stops: readonly string[]): number {
  let start = -1
  let end = Infinity
  for (const s of stops) {
    const i = text.indexOf(s)
    if (i < 0) continue
    const e = i + s.length
    if (e < end || (e === end && i < start)) { start = i; end = e }
  }
  return start
}

/** Length of the longest suffix of `text` that is a proper prefix of some stop string. */
export function heldSuffixLength (text: string, stops: readonly string[]): number {
  let best = 0
  for (const s of stops) {
    const max = Math.min(s.length - 1, text.length)
    for (let n = max; n > best; n--) {
      if (text.endsWith(s.slice(0, n))) { best = n; break }
    }
  }
  return best
}
