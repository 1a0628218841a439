/**
 * The daemon's logs on stderr (stdout stays for the lines a person or script reads: URLs, peer
 * ids, addresses). Human lines on a terminal, JSON lines (pino's own) when asked with
 * `--log-format json` or when stderr is not a terminal, so a supervisor or log shipper gets
 * structure without asking. `SHOAL_LOG_LEVEL` sets the level (info; debug adds one line per request).
 */
import { pino } from 'pino'
import type { Logger } from 'pino'

export type LogFormat = 'human' | 'json'

/** The flag wins; otherwise a terminal gets human lines and anything else JSON. */
export function resolveLogFormat (flag: string | undefined, isTTY: boolean): LogFormat {
  if (flag === 'human' || flag === 'json') return flag
  return isTTY ? 'human' : 'json'
}

const LEVELS: Record<number, string> = { 10: 'trace', 20: 'debug', 30: 'info', 40: 'warn', 50: 'error', 60: 'fatal' }
const OMIT = new Set(['level', 'time', 'pid', 'hostname', 'msg'])

function show (value: unknown): string {
  if (typeof value === 'string') return /[\s"=]/.test(value) || value === '' ? JSON.stringify(value) : value
  if (value !== null && typeof value === 'object' && typeof (value as { message?: unknown }).message === 'string') {
    return JSON.stringify((value as { message: string }).message)
  }
  return JSON.stringify(value)
}

/** One pino JSON record → "HH:MM:SS level msg key=value …" (no colours: they garble in files and CI logs). */
export function formatHuman (record: Record<string, unknown>): string {
  const time = typeof record.time === 'number' ? new Date(record.time).toISOString().slice(11, 19) : '--:--:--'
  const level = (LEVELS[record.level as number] ?? String(record.level)).padEnd(5)
  const fields = Object.entries(record).filter(([k, v]) => !OMIT.has(k) && v !== undefined).map(([k, v]) => `${k}=${show(v)}`)
  return [time, level, typeof record.msg === 'string' ? record.msg : '', ...fields].filter(s => s !== '').join(' ')
}

export function cliLogger (format: LogFormat = resolveLogFormat(undefined, process.stderr.isTTY === true)): Logger {
  const level = process.env.SHOAL_LOG_LEVEL ?? 'info'
  if (format === 'json') return pino({ level }, pino.destination(2))
  return pino({ level }, {
    write (line: string) {
      let record: Record<string, unknown>
      try {
        record = JSON.parse(line) as Record<string, unknown>
      } catch {
        process.stderr.write(line)
        return
      }
      process.stderr.write(formatHuman(record) + '\n')
    },
  })
}
