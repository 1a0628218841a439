/**
 * planRows and rowCapacity (daemon/engine/kv-rows.ts): which rows of a shared KV block a batched
 * run takes, as a pure decision — members stay where they can, only the rows that must move move.
 */
import { describe, expect, it } from 'vitest'
import { planRows, rowCapacity } from '../../daemon/engine/kv-rows.ts'
import type { RowPlan, RowsNow } from '../../daemon/engine/kv-rows.ts'

/** Carries a plan out on a row table (row → holder name) and returns the run's rows: what the runner would feed. */
function apply (table: Array<string | undefined>, group: string[], plan: RowPlan): { rows: string[], table: Array<string | undefined>, outside: string[] } {
  const t = [...table]
  const outside: string[] = []
  for (const { from, to } of plan.evict) {
    const who = t[from]!
    if (to === undefined) outside.push(who)
    else { expect(t[to]).toBeUndefined(); t[to] = who }
    t[from] = undefined
  }
  for (const { entry, to } of plan.bring) {
    const who = group[entry]!
    const was = t.indexOf(who)
    if (was >= 0) t[was] = undefined
    expect(t[to]).toBeUndefined()
    t[to] = who
  }
  return { rows: plan.order.map(e => group[e]!), table: t, outside }
}

/** RowsNow for a table of holders, a group, and who outside the group is running. */
function now (table: Array<string | undefined>, group: string[], running: string[] = []): RowsNow {
  return {
    capacity: table.length,
    members: group.map(g => { const r = table.indexOf(g); return r < 0 ? undefined : r }),
    others: table.flatMap((who, row) => who === undefined || group.includes(who) ? [] : [{ row, movable: !running.includes(who) }]),
  }
}

describe('planRows', () => {
  it('the same members in the same rows: nothing moves, rows in block order whatever the group order', () => {
    const table = ['a', 'b', 'c', undefined]
    const plan = planRows(now(table, ['c', 'a', 'b']))!
    expect(plan.evict).toEqual([])
    expect(plan.bring).toEqual([])
    expect(plan.order).toEqual([1, 2, 0])
  })

  it('a joiner is copied into the first free row, and nobody else moves', () => {
    const table = ['a', 'b', 'c', undefined, undefined]
    const plan = planRows(now(table, ['a', 'b', 'c', 'd']))!
    expect(plan.bring).toEqual([{ entry: 3, to: 3 }])
    expect(apply(table, ['a', 'b', 'c', 'd'], plan).rows).toEqual(['a', 'b', 'c', 'd'])
  })

  it('a leaver\'s row is refilled by the member past the run\'s rows: one row moves', () => {
    const table = ['a', undefined, 'c', 'd']
    const plan = planRows(now(table, ['a', 'c', 'd']))!
    expect(plan.bring).toEqual([{ entry: 2, to: 1 }])
    expect(apply(table, ['a', 'c', 'd'], plan).rows).toEqual(['a', 'd', 'c'])
  })

  it('another sequence in the way moves to a row nobody holds, or out of the block when there is none', () => {
    const table = ['a', 'x', 'c', undefined]
    const spare = planRows(now(table, ['a', 'c']))!
    expect(spare.evict).toEqual([{ from: 1, to: 3 }])
    expect(apply(table, ['a', 'c'], spare)).toMatchObject({ rows: ['a', 'c'], table: ['a', 'c', undefined, 'x'] })

    const full = ['a', 'x', 'c', 'y']
    const out = planRows(now(full, ['a', 'c']))!
    expect(out.evict).toEqual([{ from: 1, to: undefined }])
    expect(apply(full, ['a', 'c'], out)).toMatchObject({ rows: ['a', 'c'], outside: ['x'] })
  })

  it('no plan when another sequence in the way has a step running, the group outgrows the block, or none of it is there', () => {
    expect(planRows(now(['a', 'x', 'c', undefined], ['a', 'c'], ['x']))).toBeUndefined()
    // A running sequence past the run's rows is not in the way.
    expect(planRows(now(['a', 'c', 'x'], ['a', 'c'], ['x']))).toMatchObject({ evict: [], bring: [] })
    expect(planRows(now(['a', 'b'], ['a', 'b', 'c']))).toBeUndefined()
    expect(planRows(now([undefined, 'x', undefined], ['a', 'b']))).toBeUndefined()
    expect(planRows({ capacity: 4, members: [], others: [] })).toBeUndefined()
  })

  it('every mix of members, others and free rows ends with exactly the group in the first rows and every other sequence kept', () => {
    const names = ['a', 'b', 'c', 'd', 'e', 'x', 'y']
    let seed = 7
    const rand = (n: number): number => { seed = (Math.imul(seed, 1664525) + 1013904223) >>> 0; return (seed >>> 8) % n }
    for (let trial = 0; trial < 2000; trial++) {
      const capacity = 2 + rand(7)
      const table: Array<string | undefined> = Array.from({ length: capacity }, () => undefined)
      for (const who of names) if (rand(2) === 0) { const r = rand(capacity); if (table[r] === undefined) table[r] = who }
      const group = names.filter(n => n < 'x' && rand(3) > 0)
      const plan = planRows(now(table, group))
      const inBlock = group.filter(g => table.includes(g)).length
      if (group.length === 0 || group.length > capacity || inBlock === 0) { expect(plan).toBeUndefined(); continue }
      expect(plan).toBeDefined()
      const done = apply(table, group, plan!)
      expect([...done.rows].sort()).toEqual([...group].sort())
      expect(done.table.slice(0, group.length)).toEqual(done.rows)
      // Members already in the run's rows stayed; every other sequence is still somewhere.
      group.forEach(g => { const r = table.indexOf(g); if (r >= 0 && r < group.length) expect(done.table[r]).toBe(g) })
      for (const o of table) if (o !== undefined && !group.includes(o)) expect(done.table.includes(o) || done.outside.includes(o)).toBe(true)
      // One copy per row that moved, no more.
      const misplaced = group.filter(g => { const r = table.indexOf(g); return r < 0 || r >= group.length }).length
      expect(plan!.bring.length).toBe(misplaced)
    }
  })
})

describe('rowCapacity', () => {
  it('half as many rows again, within the runner\'s bound, never fewer than the group', () => {
    expect([2, 3, 4, 5, 6, 7, 8].map(n => rowCapacity(n, 8))).toEqual([3, 5, 6, 8, 8, 8, 8])
    expect(rowCapacity(2, 2)).toBe(2)
    expect(rowCapacity(9, 8)).toBe(9)
  })

  it('a row for every sequence the runner has open (a burst\'s others join next), within its bound', () => {
    expect(rowCapacity(2, 8, 8)).toBe(8)
    expect(rowCapacity(2, 8, 4)).toBe(4)
    expect(rowCapacity(2, 8, 2)).toBe(3) // half as many again still
    expect(rowCapacity(2, 4, 9)).toBe(4)
  })
})
