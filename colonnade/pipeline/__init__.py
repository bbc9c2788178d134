"""Pipeline parallelism: schedules as data, a checker and a timing simulator."""
