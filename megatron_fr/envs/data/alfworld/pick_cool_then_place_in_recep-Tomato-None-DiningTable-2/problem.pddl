;; Hand-written in ALFWorld's format (ALFRED ids, its alfred domain): a kitchen with two
;; cabinets, a countertop, a dining table, a fridge and a microwave; the task: cool the tomato
;; and put it in the dining table.
(define (problem plan_trial_2)
    (:domain alfred)
    (:objects
        agent1 - agent
        TomatoType - otype
        KnifeType - otype
        PlateType - otype
        CabinetType - rtype
        CounterTopType - rtype
        DiningTableType - rtype
        FridgeType - rtype
        MicrowaveType - rtype
        Tomato_bar__plus_01_dot_10_bar__plus_01_dot_00_bar__minus_01_dot_10 - object
        Knife_bar__plus_00_dot_90_bar__plus_00_dot_97_bar__minus_00_dot_90 - object
        Plate_bar__minus_01_dot_80_bar__plus_00_dot_76_bar__plus_01_dot_20 - object
        Cabinet_bar__plus_02_dot_00_bar__plus_01_dot_80_bar__minus_01_dot_50 - receptacle
        Cabinet_bar__plus_02_dot_50_bar__plus_01_dot_80_bar__minus_01_dot_50 - receptacle
        CounterTop_bar__plus_01_dot_00_bar__plus_00_dot_95_bar__minus_01_dot_00 - receptacle
        DiningTable_bar__minus_02_dot_00_bar__plus_00_dot_75_bar__plus_01_dot_50 - receptacle
        Fridge_bar__minus_01_dot_50_bar__plus_00_dot_00_bar__minus_02_dot_50 - receptacle
        Microwave_bar__plus_01_dot_50_bar__plus_01_dot_20_bar__minus_02_dot_00 - receptacle
        loc_bar_0_bar_0_bar_0_bar_30 - location
        loc_bar_7_bar__minus_5_bar_1_bar_0 - location
        loc_bar_8_bar__minus_5_bar_1_bar_0 - location
        loc_bar_4_bar__minus_3_bar_1_bar_45 - location
        loc_bar__minus_6_bar_5_bar_3_bar_45 - location
        loc_bar__minus_5_bar__minus_8_bar_2_bar_30 - location
        loc_bar_6_bar__minus_7_bar_2_bar_0 - location
    )
    (:init
        (atLocation agent1 loc_bar_0_bar_0_bar_0_bar_30)
        (receptacleType Cabinet_bar__plus_02_dot_00_bar__plus_01_dot_80_bar__minus_01_dot_50 CabinetType)
        (receptacleAtLocation Cabinet_bar__plus_02_dot_00_bar__plus_01_dot_80_bar__minus_01_dot_50 loc_bar_7_bar__minus_5_bar_1_bar_0)
        (openable Cabinet_bar__plus_02_dot_00_bar__plus_01_dot_80_bar__minus_01_dot_50)
        (receptacleType Cabinet_bar__plus_02_dot_50_bar__plus_01_dot_80_bar__minus_01_dot_50 CabinetType)
        (receptacleAtLocation Cabinet_bar__plus_02_dot_50_bar__plus_01_dot_80_bar__minus_01_dot_50 loc_bar_8_bar__minus_5_bar_1_bar_0)
        (openable Cabinet_bar__plus_02_dot_50_bar__plus_01_dot_80_bar__minus_01_dot_50)
        (receptacleType CounterTop_bar__plus_01_dot_00_bar__plus_00_dot_95_bar__minus_01_dot_00 CounterTopType)
        (receptacleAtLocation CounterTop_bar__plus_01_dot_00_bar__plus_00_dot_95_bar__minus_01_dot_00 loc_bar_4_bar__minus_3_bar_1_bar_45)
        (receptacleType DiningTable_bar__minus_02_dot_00_bar__plus_00_dot_75_bar__plus_01_dot_50 DiningTableType)
        (receptacleAtLocation DiningTable_bar__minus_02_dot_00_bar__plus_00_dot_75_bar__plus_01_dot_50 loc_bar__minus_6_bar_5_bar_3_bar_45)
        (receptacleType Fridge_bar__minus_01_dot_50_bar__plus_00_dot_00_bar__minus_02_dot_50 FridgeType)
        (receptacleAtLocation Fridge_bar__minus_01_dot_50_bar__plus_00_dot_00_bar__minus_02_dot_50 loc_bar__minus_5_bar__minus_8_bar_2_bar_30)
        (openable Fridge_bar__minus_01_dot_50_bar__plus_00_dot_00_bar__minus_02_dot_50)
        (receptacleType Microwave_bar__plus_01_dot_50_bar__plus_01_dot_20_bar__minus_02_dot_00 MicrowaveType)
        (receptacleAtLocation Microwave_bar__plus_01_dot_50_bar__plus_01_dot_20_bar__minus_02_dot_00 loc_bar_6_bar__minus_7_bar_2_bar_0)
        (openable Microwave_bar__plus_01_dot_50_bar__plus_01_dot_20_bar__minus_02_dot_00)
        (objectType Tomato_bar__plus_01_dot_10_bar__plus_01_dot_00_bar__minus_01_dot_10 TomatoType)
        (objectAtLocation Tomato_bar__plus_01_dot_10_bar__plus_01_dot_00_bar__minus_01_dot_10 loc_bar_4_bar__minus_3_bar_1_bar_45)
        (inReceptacle Tomato_bar__plus_01_dot_10_bar__plus_01_dot_00_bar__minus_01_dot_10 CounterTop_bar__plus_01_dot_00_bar__plus_00_dot_95_bar__minus_01_dot_00)
        (pickupable Tomato_bar__plus_01_dot_10_bar__plus_01_dot_00_bar__minus_01_dot_10)
        (cleanable Tomato_bar__plus_01_dot_10_bar__plus_01_dot_00_bar__minus_01_dot_10)
        (heatable Tomato_bar__plus_01_dot_10_bar__plus_01_dot_00_bar__minus_01_dot_10)
        (coolable Tomato_bar__plus_01_dot_10_bar__plus_01_dot_00_bar__minus_01_dot_10)
        (sliceable Tomato_bar__plus_01_dot_10_bar__plus_01_dot_00_bar__minus_01_dot_10)
        (objectType Knife_bar__plus_00_dot_90_bar__plus_00_dot_97_bar__minus_00_dot_90 KnifeType)
        (objectAtLocation Knife_bar__plus_00_dot_90_bar__plus_00_dot_97_bar__minus_00_dot_90 loc_bar_4_bar__minus_3_bar_1_bar_45)
        (inReceptacle Knife_bar__plus_00_dot_90_bar__plus_00_dot_97_bar__minus_00_dot_90 CounterTop_bar__plus_01_dot_00_bar__plus_00_dot_95_bar__minus_01_dot_00)
        (pickupable Knife_bar__plus_00_dot_90_bar__plus_00_dot_97_bar__minus_00_dot_90)
        (cleanable Knife_bar__plus_00_dot_90_bar__plus_00_dot_97_bar__minus_00_dot_90)
        (objectType Plate_bar__minus_01_dot_80_bar__plus_00_dot_76_bar__plus_01_dot_20 PlateType)
        (objectAtLocation Plate_bar__minus_01_dot_80_bar__plus_00_dot_76_bar__plus_01_dot_20 loc_bar_7_bar__minus_5_bar_1_bar_0)
        (inReceptacle Plate_bar__minus_01_dot_80_bar__plus_00_dot_76_bar__plus_01_dot_20 Cabinet_bar__plus_02_dot_00_bar__plus_01_dot_80_bar__minus_01_dot_50)
        (pickupable Plate_bar__minus_01_dot_80_bar__plus_00_dot_76_bar__plus_01_dot_20)
        (cleanable Plate_bar__minus_01_dot_80_bar__plus_00_dot_76_bar__plus_01_dot_20)
        (heatable Plate_bar__minus_01_dot_80_bar__plus_00_dot_76_bar__plus_01_dot_20)
        (coolable Plate_bar__minus_01_dot_80_bar__plus_00_dot_76_bar__plus_01_dot_20)
        (canContain CabinetType PlateType)
        (canContain CabinetType KnifeType)
        (canContain CounterTopType TomatoType)
        (canContain CounterTopType KnifeType)
        (canContain CounterTopType PlateType)
        (canContain DiningTableType TomatoType)
        (canContain DiningTableType KnifeType)
        (canContain DiningTableType PlateType)
        (canContain FridgeType TomatoType)
        (canContain FridgeType PlateType)
        (canContain MicrowaveType TomatoType)
        (canContain MicrowaveType PlateType)
    )
    (:goal
        (and
            (exists (?r - receptacle)
                (exists (?o - object)
                    (and
                        (coolable ?o)
                        (objectType ?o TomatoType)
                        (receptacleType ?r DiningTableType)
                        (isCool ?o)
                        (inReceptacle ?o ?r)
                    )
                )
            )
        )
    )
)
