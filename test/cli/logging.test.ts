/**
 * Logs: human lines on a terminal, pino JSON when asked or when not a terminal; one request line
 * per completion, at debug (fastify's two info lines per request are off); progress lines for
 * long work; the line a first Ctrl-C prints says how many requests it drains.
 */
import { describe, expect, it } from 'vitest'
import { pino } from 'pino'
import { formatHuman, resolveLogFormat } from '../../scripts/logging.ts'
import { stoppingLine } from '../../scripts/run-until-signal.ts'
import { createProgress } from '../../shards/index.ts'
import { startHarness } from '../ingress/harness.ts'

function capture (level: string): { logger: pino.Logger, lines: Array<Record<string, unknown>> } {
  const lines: Array<Record<string, unknown>> = []
  const logger = pino({ level }, { write: (s: string) => { lines.push(JSON.parse(s) as Record<string, unknown>) } })
  return { logger, lines }
}

describe('log format', () => {
  it('is human on a terminal, JSON otherwise, and the flag wins', () => {
    expect(resolveLogFormat(undefined, true)).toBe('human')
    expect(resolveLogFormat(undefined, false)).toBe('json')
    expect(resolveLogFormat('json', true)).toBe('json')
    expect(resolveLogFormat('human', false)).toBe('human')
  })

  it('formats a pino record as one readable line', () => {
    const line = formatHuman({ level: 30, time: Date.parse('2026-11-30T20:01:02.345Z'), pid: 1, hostname: 'h', msg: 'mesh: peer admitted', peerId: '12D3x', name: 'node 2', err: { message: 'boom', stack: '…' } })
    expect(line).toBe('20:01:02 info  mesh: peer admitted peerId=12D3x name="node 2" err="boom"')
    expect(formatHuman({ level: 40, time: 0, msg: 'x', n: 3 })).toBe('00:00:00 warn  x n=3')
  })
})

describe('request logs', () => {
  it('are one debug line per request, nothing at info', async () => {
    for (const [level, expected] of [['info', 0], ['debug', 1]] as const) {
      const { logger, lines } = capture(level)
      const h = await startHarness({}, { logger })
      try {
        await h.client.chat.completions.create({ model: 'sim', messages: [{ role: 'user', content: 'hi' }], max_tokens: 4 })
      } finally {
        await h.stop()
      }
      const requestLines = lines.filter(l => l.msg === 'request' || l.msg === 'incoming request' || l.msg === 'request completed')
      expect(requestLines, level).toHaveLength(expected)
      if (expected === 1) expect(requestLines[0]).toMatchObject({ level: 20, method: 'POST', url: '/v1/chat/completions', status: 200 })
    }
  })
})

describe('progress lines', () => {
  it('report the first step, at most one per interval, and the end with its time', () => {
    let t = 0
    const out: string[] = []
    const step = createProgress(l => { out.push(l) }, 'compiling', { everyMs: 1000, now: () => t })
    for (let done = 1; done <= 24; done++) { t += 100; step(done, 24) }
    expect(out[0]).toBe('compiling: 1/24 layers (4%)')
    expect(out.at(-1)).toBe('compiling: 24/24 layers, done in 2.4 s')
    expect(out).toHaveLength(4)
  })
})

describe('shutdown line', () => {
  it('says how many requests a stop drains', () => {
    expect(stoppingLine('SIGINT', 0)).toBe('shoal: SIGINT, stopping (again to force)')
    expect(stoppingLine('SIGINT', 1)).toBe('shoal: SIGINT, draining 1 request (Ctrl-C again to force)')
    expect(stoppingLine('SIGTERM', 3)).toBe('shoal: SIGTERM, draining 3 requests (Ctrl-C again to force)')
  })
})
