/**
 * The coordinator's book of unacknowledged keeps (keep-acks.ts): an open from a key waits until
 * every stage asked to keep it answered, goes on without it past the bound, stops at its signal;
 * a stage that let a wait pass is not waited for again until it answers something; a stage that
 * kept nothing makes the key gone.
 */
import { describe, expect, it } from 'vitest'
import { createKeepAcks } from '../../daemon/pipeline/index.ts'

const never = new AbortController().signal

describe('keep acknowledgements', () => {
  it('is ready at once for a key with nothing pending', async () => {
    const acks = createKeepAcks()
    expect(await acks.ready('k', never, 10)).toBe('held')
    acks.expect('k', ['B', 'C'])
    acks.ack('k', 'B', 8)
    acks.ack('k', 'C', 8)
    expect(acks.pending).toBe(0)
    expect(await acks.ready('k', never, 10)).toBe('held')
  })

  it('holds every waiter until the last stage answered', async () => {
    const acks = createKeepAcks()
    acks.expect('k', ['B', 'C'])
    let done = 0
    const waits = [acks.ready('k', never, 60_000), acks.ready('k', never, 60_000)].map(async p => { const r = await p; done++; return r })
    acks.ack('k', 'B', 8)
    acks.ack('other', 'C', 8)
    await new Promise(resolve => setImmediate(resolve))
    expect(done).toBe(0)
    acks.ack('k', 'C', 8)
    expect(await Promise.all(waits)).toEqual(['held', 'held'])
    expect(acks.pending).toBe(0)
  })

  it('goes on without the prefix past the bound, and waits no more for the stage that did not answer until it answers', async () => {
    const acks = createKeepAcks()
    acks.expect('k1', ['B', 'C'])
    acks.ack('k1', 'B', 8)
    const waits = await Promise.all([acks.ready('k1', never, 5), acks.ready('k1', never, 5)])
    expect(waits).toEqual(['late', 'late'])
    // The key is settled: a later open tries it (a stage that does not hold it refuses).
    expect(await acks.ready('k1', never, 5)).toBe('held')
    // C is silent now: the next keep waits for B only.
    acks.expect('k2', ['B', 'C'])
    acks.ack('k2', 'B', 8)
    expect(await acks.ready('k2', never, 60_000)).toBe('held')
    // C answers (late): it is waited for again.
    acks.ack('k1', 'C', 8)
    acks.expect('k3', ['B', 'C'])
    acks.ack('k3', 'B', 8)
    expect(await acks.ready('k3', never, 5)).toBe('late')
  })

  it('stops waiting when the signal fires', async () => {
    const acks = createKeepAcks()
    acks.expect('k', ['B'])
    const ctl = new AbortController()
    const wait = acks.ready('k', ctl.signal, 60_000)
    ctl.abort(new Error('client gone'))
    await expect(wait).rejects.toThrow('client gone')
    // Still pending for the next open.
    expect(acks.pending).toBe(1)
    await expect(acks.ready('k', ctl.signal, 60_000)).rejects.toThrow('client gone')
  })

  it('a stage asked to keep the key that kept nothing makes it gone, now and for later opens, until it is kept again', async () => {
    const acks = createKeepAcks()
    acks.expect('k', ['B', 'C'])
    const wait = acks.ready('k', never, 60_000)
    acks.ack('k', 'B', 8)
    acks.ack('k', 'C', 0)
    expect(await wait).toBe('gone')
    expect(acks.pending).toBe(0)
    expect(await acks.ready('k', never, 5)).toBe('gone')
    // A new finish keeps it again: asked anew.
    acks.expect('k', ['B', 'C'])
    acks.ack('k', 'B', 8)
    acks.ack('k', 'C', 8)
    expect(await acks.ready('k', never, 5)).toBe('held')
  })

  it('a 0 from a stage not asked, or after the key settled, changes nothing', async () => {
    const acks = createKeepAcks()
    acks.expect('k', ['B'])
    acks.ack('k', 'X', 0)
    expect(acks.pending).toBe(1)
    acks.ack('k', 'B', 8)
    acks.ack('k', 'B', 0)
    expect(await acks.ready('k', never, 5)).toBe('held')
    acks.ack('never-asked', 'B', 0)
    expect(await acks.ready('never-asked', never, 5)).toBe('held')
  })
})
