/**
 * The dashboard's HTTP side on a real ingress (127.0.0.1) with a scripted DashboardSource: the page
 * is self-contained HTML with a CSP that lets it load nothing from elsewhere, the state and verify
 * routes, and the event stream — state at once, a push on change, a bound on open streams, and a
 * clean `bye` + end for every stream when the ingress stops (stop does not wait on them).
 */
import { afterEach, describe, expect, it } from 'vitest'
import type { DashboardSource } from '../../daemon/ingress/index.ts'
import { expectOpenAIError, startHarness } from './harness.ts'
import type { Harness } from './harness.ts'

function scriptedSource (): DashboardSource & { version: number, fire: () => void } {
  const listeners = new Set<() => void>()
  const source = {
    version: 1,
    async state () { return { format: 'test', version: source.version } },
    async verify (id: string) { return id === 'r-1' ? { id, ok: true, checks: [] } : undefined },
    onChange (l: () => void) { listeners.add(l); return () => { listeners.delete(l) } },
    fire () { for (const l of listeners) l() },
  }
  return source
}

/** Reads SSE events from a streaming response until `until` says stop or the stream ends. */
async function readEvents (res: Response, until: (events: Array<{ event: string, data: string }>) => boolean): Promise<{ events: Array<{ event: string, data: string }>, ended: boolean }> {
  const reader = res.body!.pipeThrough(new TextDecoderStream()).getReader()
  const events: Array<{ event: string, data: string }> = []
  let buf = ''
  for (;;) {
    const { value, done } = await reader.read()
    if (done) return { events, ended: true }
    buf += value
    let at: number
    while ((at = buf.indexOf('\n\n')) >= 0) {
      const block = buf.slice(0, at)
      buf = buf.slice(at + 2)
      const event = /^event: (.*)$/m.exec(block)?.[1]
      const data = /^data: (.*)$/m.exec(block)?.[1]
      if (event !== undefined && data !== undefined) events.push({ event, data })
    }
    if (until(events)) {
      await reader.cancel()
      return { events, ended: false }
    }
  }
}

let h: Harness | undefined
afterEach(async () => { await h?.stop(); h = undefined })

describe('dashboard routes', () => {
  it('GET / is a self-contained HTML page that loads nothing from elsewhere', async () => {
    h = await startHarness({}, {}, { dashboard: scriptedSource() })
    const res = await fetch(`${h.url}/`)
    expect(res.status).toBe(200)
    expect(res.headers.get('content-type')).toMatch(/^text\/html/)
    expect(res.headers.get('content-security-policy')).toContain("default-src 'none'")
    expect(res.headers.get('content-security-policy')).toContain("connect-src 'self'")
    const html = await res.text()
    expect(html).toContain('/dashboard/events')
    // No external scripts, styles or images.
    expect(html).not.toMatch(/<script[^>]+src=|<link[^>]+href=|https?:\/\/(?!www\.w3\.org)/)
  })

  it('without a dashboard source there is no page (404 in the OpenAI error shape)', async () => {
    h = await startHarness()
    const res = await fetch(`${h.url}/`)
    expect(res.status).toBe(404)
    expectOpenAIError(await res.json())
  })

  it('state and verify: 200 with the source\'s JSON, 404 for an unknown receipt', async () => {
    h = await startHarness({}, {}, { dashboard: scriptedSource() })
    expect(await (await fetch(`${h.url}/dashboard/state`)).json()).toEqual({ format: 'test', version: 1 })
    expect(await (await fetch(`${h.url}/dashboard/receipts/r-1/verify`)).json()).toEqual({ id: 'r-1', ok: true, checks: [] })
    const missing = await fetch(`${h.url}/dashboard/receipts/nope/verify`)
    expect(missing.status).toBe(404)
    expect(expectOpenAIError(await missing.json()).code).toBe('SHOAL_ERR_NOT_FOUND')
  })

  it('the event stream sends the state at once and again when the source changes', async () => {
    const source = scriptedSource()
    h = await startHarness({}, {}, { dashboard: source })
    const res = await fetch(`${h.url}/dashboard/events`)
    expect(res.headers.get('content-type')).toMatch(/^text\/event-stream/)
    const { events } = await readEvents(res, evs => {
      if (evs.length === 1) { source.version = 2; source.fire() }
      return evs.some(e => JSON.parse(e.data).version === 2)
    })
    expect(events[0]).toEqual({ event: 'state', data: JSON.stringify({ format: 'test', version: 1 }) })
    expect(events.map(e => e.event)).toEqual(events.map(() => 'state'))
  })

  it('a client that goes away frees its stream slot', async () => {
    h = await startHarness({}, {}, { dashboard: scriptedSource() })
    const controllers = Array.from({ length: 32 }, () => new AbortController())
    const open = await Promise.all(controllers.map(async c => await fetch(`${h!.url}/dashboard/events`, { signal: c.signal })))
    expect(open.every(r => r.status === 200)).toBe(true)
    expect((await fetch(`${h.url}/dashboard/events`)).status).toBe(429)
    controllers[0]!.abort()
    let next: Response | undefined
    const deadline = Date.now() + 10_000
    while (Date.now() < deadline) {
      const r = await fetch(`${h.url}/dashboard/events`)
      if (r.status === 200) { next = r; break }
      await r.body?.cancel()
      await new Promise(resolve => setTimeout(resolve, 50))
    }
    expect(next?.status).toBe(200)
    await next?.body?.cancel()
    for (const c of controllers) c.abort()
  })

  it('streams are bounded: one past maxClients gets 429; the ingress stop ends every stream with bye', async () => {
    h = await startHarness({}, {}, { dashboard: scriptedSource() })
    // The default bound is 32 streams.
    const open = await Promise.all(Array.from({ length: 32 }, async () => await fetch(`${h!.url}/dashboard/events`)))
    expect(open.every(r => r.status === 200)).toBe(true)
    const refused = await fetch(`${h.url}/dashboard/events`)
    expect(refused.status).toBe(429)
    expectOpenAIError(await refused.json())
    // Read each stream to its end while the ingress stops.
    const reads = open.map(async r => await readEvents(r, () => false))
    const stopping = h.stop()
    h = undefined
    const results = await Promise.all(reads)
    await stopping
    for (const r of results) {
      expect(r.ended).toBe(true)
      expect(r.events[0]?.event).toBe('state')
      expect(r.events.at(-1)?.event).toBe('bye')
    }
  })
})
