/**
 * findLoneSurrogate: the first ill-formed string in document order, with its path in OpenAI's
 * `param` notation, through arrays and objects of any mix (numbers and other primitives between
 * them are passed over).
 */
import { describe, expect, it } from 'vitest'
import { findLoneSurrogate } from '../../daemon/text/well-formed.ts'

const lone = 'a\ud800b'

describe('findLoneSurrogate', () => {
  it('passes well-formed values of every shape', () => {
    expect(findLoneSurrogate('plain')).toBeUndefined()
    expect(findLoneSurrogate({ model: 'm', prompt: [1, 2, 3], stop: ['x', null], n: 1, stream: true })).toBeUndefined()
    expect(findLoneSurrogate(Array.from({ length: 2000 }, (_, i) => i))).toBeUndefined()
    expect(findLoneSurrogate('pair \ud83d\ude00 is fine')).toBeUndefined()
  })

  it('names the first lone surrogate in document order, among numbers and nested values', () => {
    expect(findLoneSurrogate(lone)).toBe('')
    expect(findLoneSurrogate({ prompt: [1, 2, lone, 4] })).toBe('prompt[2]')
    expect(findLoneSurrogate({ messages: [{ role: 'user', content: 'ok' }, 7, { role: 'user', content: [{ type: 'text', text: lone }] }], stop: lone }))
      .toBe('messages[2].content[0].text')
    // A later sibling's string does not win over an earlier sibling's nested one.
    expect(findLoneSurrogate([5, [null, lone], lone])).toBe('[1][1]')
    expect(findLoneSurrogate({ [lone]: 1 })).toBe(lone)
    expect(findLoneSurrogate([1, 2, lone], 'prompt')).toBe('prompt[2]')
  })
})
