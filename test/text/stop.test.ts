import { describe, expect, it } from 'vitest'
import fc from 'fast-check'
import { createStopMatcher, heldSuffixLength } from '../../daemon/text/index.ts'

/** Feeds chunks through a matcher; returns what it emitted and whether it stopped. */
function run (stops: string[], chunks: string[]): { out: string, stopped: boolean } {
  const m = createStopMatcher(stops)
  let out = ''
  for (const c of chunks) {
    const r = m.push(c)
    out += r.text
    if (r.stopped) return { out, stopped: true }
  }
  return { out: out + m.flush(), stopped: false }
}

/**
 * The reference: read the whole text one character (code point) at a time and stop as soon as the
 * text so far ends with a stop string; cut it where that stop string starts.
 */
function reference (stops: string[], text: string): { out: string, stopped: boolean } {
  let seen = ''
  for (const ch of text) {
    seen += ch
    const hit = stops.filter(s => s.length > 0 && seen.endsWith(s)).sort((a, b) => b.length - a.length)[0]
    if (hit !== undefined) return { out: seen.slice(0, seen.length - hit.length), stopped: true }
  }
  return { out: text, stopped: false }
}

describe('stop strings', () => {
  it('holds back a possible stop prefix until it is decided', () => {
    const m = createStopMatcher(['</end>'])
    expect(m.push('hello </')).toEqual({ text: 'hello ', stopped: false })
    expect(m.push('e')).toEqual({ text: '', stopped: false })
    expect(m.push('x!')).toEqual({ text: '</ex!', stopped: false })
    expect(m.push('ok </en')).toEqual({ text: 'ok ', stopped: false })
    expect(m.push('d> tail')).toEqual({ text: '', stopped: true })
    expect(m.flush()).toBe('')
  })

  it('stops at the stop string completed first, across chunk boundaries, whatever the chunking', () => {
    // 'bc' completes before 'abcd' could: generation would never get to the 'd'.
    expect(run(['bc', 'abcd'], ['xa', 'b', 'cd'])).toEqual({ out: 'xa', stopped: true })
    expect(run(['bc', 'abcd'], ['xabcd'])).toEqual({ out: 'xa', stopped: true })
    expect(run(['bc', 'abcd'], ['xa', 'b', 'c'])).toEqual({ out: 'xa', stopped: true })
    // Two completing together: the one that starts first (the longer) is cut.
    expect(run(['cd', 'abcd'], ['xab', 'cd'])).toEqual({ out: 'x', stopped: true })
    expect(run(['\na\nb', 'a'], ['\na\n', 'b'])).toEqual({ out: '\n', stopped: true })
    expect(run(['\na\nb', 'a'], ['\na\nb'])).toEqual({ out: '\n', stopped: true })
    expect(run(['\n\n', 'User:'], ['a\n', '\nUser:'])).toEqual({ out: 'a', stopped: true })
  })

  it('flushes held text when the stream ends without a stop', () => {
    expect(run(['STOP'], ['abc ST'])).toEqual({ out: 'abc ST', stopped: false })
  })

  it('longest held suffix is a proper prefix of a stop string', () => {
    expect(heldSuffixLength('aaab', ['abx', 'b'])).toBe(2)
    expect(heldSuffixLength('xyz', ['abc'])).toBe(0)
  })

  it('property: output never contains a stop string and equals the text cut at the first stop', () => {
    const alphabet = fc.constantFrom('a', 'b', 'c', 'é', '😀', '\n')
    const str = fc.array(alphabet, { maxLength: 30 }).map(a => a.join(''))
    fc.assert(fc.property(
      fc.array(fc.array(alphabet, { minLength: 1, maxLength: 4 }).map(a => a.join('')), { minLength: 1, maxLength: 3 }),
      fc.array(str, { maxLength: 12 }),
      (stops, chunks) => {
        const got = run(stops, chunks)
        const want = reference(stops, chunks.join(''))
        expect(got).toEqual(want)
        for (const s of stops) expect(got.out.includes(s)).toBe(false)
      },
    ), { numRuns: 500 })
  })
})
